"""Fixtures for the token processor tests: a real byte-level BPE tokenizer and step helpers.

The tokenizer is the tiny model's (``fd_core.testing.tiny_model``): a byte-level BPE with a
512-entry vocabulary, small enough that emoji and most CJK characters are split over several
tokens, which is what the UTF-8 hold-back logic must survive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from fd_core.model.tokenizer import Tokenizer
from fd_core.outputs import RequestOutput, SampledToken, ScheduledRequest, StepPlan, StepResult
from fd_core.request import Request, SamplingParams
from fd_core.testing.tiny_model import make_tiny_llama
from fd_plugins.token_processors.default import DefaultTokenProcessor, DefaultTokenProcessorSettings

EOS = 2   # <|im_end|> in the tiny tokenizer


class Harness:
    """Builds processors, requests and hand-made decode steps over the tiny tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def processor(self, *, max_model_len: int = 4096, **settings: Any) -> DefaultTokenProcessor:
        """A fresh processor over the tiny tokenizer."""
        return DefaultTokenProcessor(DefaultTokenProcessorSettings(**settings), tokenizer=self.tokenizer,
                                     max_model_len=max_model_len)

    @staticmethod
    def request(request_id: str = "r0", *, prompt: Sequence[int] = (5, 6, 7), **params: Any) -> Request:
        params.setdefault("max_tokens", 1000)
        return Request(request_id, list(prompt), SamplingParams(**params), eos_token_ids=(EOS,))

    @staticmethod
    def step(processor: DefaultTokenProcessor, tokens: dict[Request, int | SampledToken]) -> list[RequestOutput]:
        """Run one decode step in which each request in ``tokens`` sampled its token."""
        plan = StepPlan([ScheduledRequest(r, r.num_tokens - 1, 1, [], True) for r in tokens], [], len(tokens))
        sampled = {r.request_id: t if isinstance(t, SampledToken) else SampledToken(t) for r, t in tokens.items()}
        return processor.process(plan, StepResult(sampled))

    def drive(self, processor: DefaultTokenProcessor, request: Request,
              token_ids: Sequence[int]) -> list[RequestOutput]:
        """Feed ``token_ids`` one per step until the request finishes; return its outputs."""
        processor.add_request(request)
        outputs = []
        for token_id in token_ids:
            (output,) = self.step(processor, {request: token_id})
            outputs.append(output)
            if output.finished:
                break
        return outputs

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    @staticmethod
    def text(outputs: Sequence[RequestOutput]) -> str:
        """The concatenated text deltas of a request's outputs."""
        return "".join(o.new_text for o in outputs)


@pytest.fixture(scope="session")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Harness:
    return Harness(Tokenizer.from_folder(make_tiny_llama(tmp_path_factory.mktemp("tiny"))))
