"""Fixtures for the token processor tests: a real byte-level BPE tokenizer and a recording manager.

The tokenizer is the tiny model's (``fd_core.testing.tiny_model``): a byte-level BPE with a
512-entry vocabulary, small enough that emoji and most CJK characters are split over several
tokens, which is what the UTF-8 hold-back logic must survive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from fd_core.contracts.resource_manager import KVLimits, KVStats, ResourceManager
from fd_core.model.tokenizer import Tokenizer
from fd_core.outputs import RequestOutput, SampledToken, ScheduledRequest, StepPlan, StepResult
from fd_core.request import FinishReason, Request, SamplingParams
from fd_core.testing.tiny_model import make_tiny_llama
from fd_plugins.token_processors.default import DefaultTokenProcessor, DefaultTokenProcessorSettings

EOS = 2   # <|im_end|> in the tiny tokenizer


class RecordingResourceManager(ResourceManager):
    """A resource manager double that only records ``finish_requests`` calls."""

    name = "recording"
    fd_hookspec_version = 1

    def __init__(self) -> None:
        super().__init__(None, limits=KVLimits(num_blocks=1, block_size=16, max_num_seqs=512,
                                               max_num_batched_tokens=8192, max_model_len=4096), hooks=None)
        self.calls: list[tuple[list[str], FinishReason]] = []

    def finish_requests(self, requests: list[Request], reason: FinishReason) -> None:
        self.calls.append(([r.request_id for r in requests], reason))

    def add_request(self, request: Request) -> None:
        raise NotImplementedError

    def schedule(self) -> StepPlan:
        raise NotImplementedError

    def abort(self, request_id: str) -> Request | None:
        raise NotImplementedError

    def num_free_blocks(self) -> int:
        return 1

    def has_unfinished(self) -> bool:
        return False

    def stats(self) -> KVStats:
        return KVStats(num_blocks=1, num_free_blocks=1, num_running=0, num_waiting=0)


class Harness:
    """Builds processors, requests and hand-made decode steps over the tiny tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def processor(self, *, max_model_len: int = 4096, **settings: Any) -> DefaultTokenProcessor:
        """A processor with a fresh :class:`RecordingResourceManager` (``.resource_manager``)."""
        return DefaultTokenProcessor(DefaultTokenProcessorSettings(**settings), tokenizer=self.tokenizer,
                                     resource_manager=RecordingResourceManager(), max_model_len=max_model_len)

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
