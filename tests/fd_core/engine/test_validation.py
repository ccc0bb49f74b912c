"""Requests that can never be served are refused before scheduling, naming the limit."""

from __future__ import annotations

import pytest

from fd_core.errors import RequestError
from fd_core.request import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from fd_core.config import load_config
    from fd_core.engine.llm import LLM

    return LLM(config=load_config(model={"source": tiny_model_dir, "max_model_len": 128},
                                  cache={"num_blocks": 64}))


def test_prompt_longer_than_max_model_len_is_rejected(llm):
    with pytest.raises(RequestError, match=r"prompt has 200 tokens; max_model_len is 128") as info:
        llm.generate([[5] * 200], SamplingParams(max_tokens=4))
    assert info.value.field == "prompt"
    assert llm.engine.scheduler.num_waiting() == 0


def test_max_tokens_that_cannot_fit_is_rejected(llm):
    with pytest.raises(RequestError, match=r"prompt \(100 tokens\) \+ max_tokens \(50\) = 150 "
                                           r"exceeds max_model_len \(128\)") as info:
        llm.generate([[5] * 100], SamplingParams(max_tokens=50))
    assert info.value.field == "max_tokens"


def test_invalid_sampling_field_is_named(llm):
    with pytest.raises(RequestError, match=r"top_p: must be in \(0, 1\]") as info:
        llm.generate([[5, 6]], SamplingParams(top_p=0))
    assert info.value.field == "top_p"


def test_one_bad_prompt_queues_nothing(llm):
    with pytest.raises(RequestError):
        llm.generate([[5, 6, 7], [5] * 500], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished()
    ok = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(ok[0].token_ids) == 4
