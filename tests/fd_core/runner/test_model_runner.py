"""Prompt logprobs from the model runner: the log-softmax of the logits each prompt position gives
the next prompt token, computed once per position whatever the chunking."""

from __future__ import annotations

import numpy as np
import pytest

from fd_core.outputs import ScheduledRequest, StepPlan
from fd_core.request import Request, SamplingParams
from fd_core.runner.model_runner import ModelRunner
from fd_plugins.models.llama import LlamaFamily
from tests.fd_core.model.tiny_llama import GreedySampler, random_weights, tiny_arch

BLOCK_SIZE = 16
PROMPT = np.random.default_rng(3).integers(0, 256, 30).tolist()
TOP_N = 3


def _runner(sampler: GreedySampler) -> ModelRunner:
    arch = tiny_arch()
    return ModelRunner(LlamaFamily(), arch, random_weights(arch), num_blocks=16, block_size=BLOCK_SIZE,
                       sampler=sampler)


def _step(runner: ModelRunner, *rows: ScheduledRequest):
    """Run one step of ``rows`` and keep their prompt logprobs as the engine core does."""
    result = runner.execute(StepPlan(list(rows), total_num_tokens=sum(r.num_new_tokens for r in rows)))
    for row in rows:
        row.request.num_computed_tokens = row.start + row.num_new_tokens
        row.request.prompt_logprobs.extend(result.prompt_logprobs.get(row.request.request_id, ()))
    return result


@pytest.fixture(scope="module")
def oracle() -> np.ndarray:
    """log_softmax (float64) of the logits predicting prompt token p + 1, from a plain prefill of
    the prefix ``PROMPT[:p + 1]`` that samples at its end: rows for p = 0 .. len - 2."""
    sampler = GreedySampler()
    runner = _runner(sampler)
    for p in range(1, len(PROMPT)):
        _step(runner, ScheduledRequest(Request(f"prefix-{p}", PROMPT[:p]), 0, p, [1, 2], sample=True))
    logits = np.stack([sampler.logits[f"prefix-{p}"][0] for p in range(1, len(PROMPT))]).astype(np.float64)
    peak = logits.max(axis=-1, keepdims=True)
    return logits - peak - np.log(np.exp(logits - peak).sum(axis=-1, keepdims=True))


def _check(logprobs, oracle: np.ndarray) -> None:
    assert [t.token_id for t in logprobs] == PROMPT[1:]
    np.testing.assert_allclose([t.logprob for t in logprobs], oracle[np.arange(len(PROMPT) - 1), PROMPT[1:]],
                               atol=1e-4)
    for token, row in zip(logprobs, oracle, strict=True):
        best = np.argsort(-row)[:TOP_N]
        assert [i for i, _ in token.top_logprobs] == best.tolist()
        np.testing.assert_allclose([lp for _, lp in token.top_logprobs], row[best], atol=1e-4)


def test_prompt_logprobs_are_the_log_softmax_of_each_prefix_s_next_token_logits(oracle) -> None:
    sampler = GreedySampler()
    runner = _runner(sampler)
    scored = Request("scored", PROMPT, SamplingParams(prompt_logprobs=TOP_N))
    plain = Request("plain", PROMPT[:12])   # batched beside it: its sampling row is untouched
    result = _step(runner, ScheduledRequest(plain, 0, 12, [3], sample=True),
                   ScheduledRequest(scored, 0, len(PROMPT), [1, 2], sample=True))
    _check(scored.prompt_logprobs, oracle)
    assert set(result.prompt_logprobs) == {"scored"} and set(result.sampled) == {"plain", "scored"}
    alone = GreedySampler()
    _step(_runner(alone), ScheduledRequest(Request("plain", PROMPT[:12]), 0, 12, [1], sample=True))
    np.testing.assert_allclose(sampler.logits["plain"][0], alone.logits["plain"][0], atol=1e-4)


def test_chunks_and_a_recompute_give_each_position_once(oracle) -> None:
    runner = _runner(GreedySampler())
    scored = Request("scored", PROMPT, SamplingParams(prompt_logprobs=TOP_N))
    other = Request("other", PROMPT[:5])
    _step(runner, ScheduledRequest(scored, 0, 7, [1, 2], sample=False), ScheduledRequest(other, 0, 5, [3], sample=True))
    assert len(scored.prompt_logprobs) == 7   # positions 0..6 predict prompt tokens 1..7
    _step(runner, ScheduledRequest(scored, 7, 9, [1, 2], sample=False))
    # preempted: its K/V is gone and it recomputes from 0 (in chunks of another size)
    _step(runner, ScheduledRequest(scored, 0, 10, [4, 5], sample=False))
    assert len(scored.prompt_logprobs) == 16
    result = _step(runner, ScheduledRequest(scored, 10, len(PROMPT) - 10, [4, 5], sample=True))
    assert set(result.sampled) == {"scored"}
    _check(scored.prompt_logprobs, oracle)

    # once it has an output token, a recompute computes no prompt logprobs
    scored.output_token_ids.append(result.sampled["scored"].token_id)
    again = _step(runner, ScheduledRequest(scored, 0, len(PROMPT) + 1, [4, 5], sample=True))
    assert again.prompt_logprobs == {} and len(scored.prompt_logprobs) == len(PROMPT) - 1


def test_a_row_that_starts_past_its_prompt_logprobs_computes_none() -> None:
    """A prefix-cache hit (positions it never computed) leaves the list short; the core ends the request."""
    runner = _runner(GreedySampler())
    scored = Request("scored", PROMPT, SamplingParams(prompt_logprobs=0))
    result = _step(runner, ScheduledRequest(scored, 16, len(PROMPT) - 16, [1, 2], sample=True))
    assert result.prompt_logprobs == {} and scored.prompt_logprobs == []
    one_token = Request("one", PROMPT[:1], SamplingParams(prompt_logprobs=0))   # nothing to predict
    assert _step(runner, ScheduledRequest(one_token, 0, 1, [3], sample=True)).prompt_logprobs == {}
