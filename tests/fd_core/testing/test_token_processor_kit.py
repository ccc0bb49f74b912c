"""The token processor kit: the default passes, broken processors fail naming their invariant."""

from __future__ import annotations

from typing import Any

import pytest

from fd_core.testing.conformance import (
    TOKEN_PROCESSOR_CHECKS,
    ConformanceError,
    check_token_processor,
    run_token_processor_checks,
    tiny_tokenizer,
)
from fd_plugins.token_processors.default import DefaultTokenProcessor


def test_the_kits_texts_really_split_characters_over_tokens():
    tokenizer = tiny_tokenizer()
    for char in "🦀漢∑":
        assert len(tokenizer.encode(char, add_special_tokens=False)) > 1


def test_the_default_passes_every_check():
    report = check_token_processor(DefaultTokenProcessor)
    assert [r.status for r in report.results] == ["passed"] * len(TOKEN_PROCESSOR_CHECKS)


def test_options_and_factories_work():
    assert check_token_processor(DefaultTokenProcessor, options={"skip_special_tokens": True}).ok
    assert check_token_processor(lambda tokenizer, max_model_len: DefaultTokenProcessor(
        None, tokenizer=tokenizer, max_model_len=max_model_len)).ok


def test_a_processor_that_misses_stop_strings_across_tokens_is_caught(broken_plugins):
    with pytest.raises(ConformanceError) as caught:
        check_token_processor(broken_plugins.token_processor.MissesSplitStops)
    assert str(caught.value).startswith(
        "token processor invariant 'stop strings match across tokens; the text ends at the match' broken: "
        "case \"stop string 'azy d' across tokens\" (stop-0): finished at output 25 with 'length'; "
        "expected output 21 with 'stop'")


class _NaiveDetokenizer(DefaultTokenProcessor):
    """Decodes every token on its own: half characters come out as U+FFFD."""

    def _on_token(self, request: Any, token: Any, now: float) -> Any:
        output = super()._on_token(request, token, now)
        output.new_text = self.tokenizer.decode([token.token_id])
        return output


class _Leaky(DefaultTokenProcessor):
    def forget(self, request_id: str) -> None:
        pass


class _IgnoresMinTokens(DefaultTokenProcessor):
    def _new_state(self, request: Any) -> Any:
        state = super()._new_state(request)
        state.min_tokens = 0
        return state


class _IgnoresModelLen(DefaultTokenProcessor):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.max_model_len = 10**9


class _EndsRequests(DefaultTokenProcessor):
    """Sets FINISHED itself, which only the engine core may do."""

    def process(self, plan: Any, result: Any) -> Any:
        outputs = super().process(plan, result)
        finished = {o.request_id for o in outputs if o.finished}
        for row in plan.scheduled:
            if row.request.request_id in finished:
                row.request.finish_reason = outputs[0].finish_reason
        return outputs


class _NoLogprobs(DefaultTokenProcessor):
    def process(self, plan: Any, result: Any) -> Any:
        outputs = super().process(plan, result)
        for output in outputs:
            output.new_logprobs = []
        return outputs


@pytest.mark.parametrize(("cls", "check", "message"), [
    (_NaiveDetokenizer, "detokenize", "token processor invariant 'deltas concatenate to the text and never split a "
                                      "character' broken: case 'multi-byte characters over byte-level tokens'"),
    (_Leaky, "forget", "token processor invariant 'forget drops every trace of a request' broken: memory grew by"),
    (_IgnoresMinTokens, "min_tokens", "token processor invariant 'stops are ignored before min_tokens' broken: case "
                                      "'eos before min_tokens' (min-eos): finished at output 6 with 'stop'"),
    (_IgnoresModelLen, "max_model_len", "token processor invariant 'max_model_len finishes with length' broken: case "
                                        "'prompt of 61 tokens, max_model_len=64' (model-len): never finished"),
    (_EndsRequests, "eos", "token processor invariant 'process only appends the sampled token to the request' "
                           "broken: process changed 'eos''s status, finish_reason or finished_time"),
    (_NoLogprobs, "logprobs", "token processor invariant 'logprobs are attached when asked for' broken:"),
])
def test_each_broken_processor_fails_naming_its_invariant(cls, check, message):
    report = run_token_processor_checks(cls)
    assert message in report.result(check).reason, report.result(check).reason
