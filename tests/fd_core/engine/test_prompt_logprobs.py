"""Prompt logprobs through the whole engine: gathered over prefill chunks, handed out once with a
request's first output, never taken from the prefix cache, never sent again to a continuation."""

from __future__ import annotations

import numpy as np
import pytest

from fd_core.request import GuidedDecoding, Request, SamplingParams

BLOCK_SIZE = 16
PROMPTS = [np.random.default_rng(seed).integers(3, 500, n).tolist() for seed, n in ((1, 70), (2, 45), (3, 52))]


def _run(engine, requests: list[Request], max_steps: int = 2000) -> dict[str, list]:
    """Every output of each request (ending on the model's eos ids), stepping the engine until all finished."""
    for request in requests:
        request.eos_token_ids = tuple(engine.tokenizer.eos_token_ids)
        engine.add_request(request)
    outputs: dict[str, list] = {r.request_id: [] for r in requests}
    for _ in range(max_steps):
        engine.step()
        for output in engine.get_results(timeout=0):
            outputs[output.request_id].append(output)
        if all(outs and outs[-1].finished for outs in outputs.values()):
            return outputs
    raise AssertionError(f"not finished after {max_steps} steps")


def _all_blocks_free(engine) -> bool:
    stats = engine.resource_manager.stats()
    return stats.num_free_blocks == stats.num_blocks and stats.num_running == stats.num_waiting == 0


def _values(logprobs) -> list[tuple]:
    return [(t.token_id, t.logprob, [i for i, _ in t.top_logprobs]) for t in logprobs]


def _close(got, want) -> None:
    assert [(t, top) for t, _, top in _values(got)] == [(t, top) for t, _, top in _values(want)]
    np.testing.assert_allclose([t.logprob for t in got], [t.logprob for t in want], atol=1e-4)


@pytest.fixture(scope="module")
def alone(tiny_model_dir):
    """Each prompt's logprobs (top 2) from one whole-prompt prefill, no prefix cache."""
    from fd_core.engine.llm import LLM

    llm = LLM(model=tiny_model_dir, cache={"num_blocks": 64, "block_size": BLOCK_SIZE, "enable_prefix_caching": False},
              engine={"max_num_batched_tokens": 512})
    results = llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))
    assert all(len(r.prompt_logprobs) == len(p) - 1 for r, p in zip(results, PROMPTS, strict=True))
    return [r.prompt_logprobs for r in results]


def test_chunked_batched_and_preempted_requests_get_their_prompt_logprobs_once(make_llm, alone):
    """A small budget chunks every prompt, a small pool preempts; the rows mix the all-greedy fast
    path, a sampled row with logprobs and a constrained row."""
    llm = make_llm(cache={"num_blocks": 11, "block_size": BLOCK_SIZE, "enable_prefix_caching": False},
                   engine={"max_num_batched_tokens": 24, "max_num_seqs": 4})
    params = [SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(max_tokens=40, temperature=0.8, seed=5, logprobs=1, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(max_tokens=30, temperature=0.0, guided=GuidedDecoding("regex", "[a-z]{3,40}"),
                             prompt_logprobs=2)]
    plain = Request("plain", PROMPTS[0][:20], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    scored = [Request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True))]
    outputs = _run(llm.engine, [*scored, plain])
    assert llm.engine.resource_manager.stats().num_preemptions > 0
    for i, want in enumerate(alone):
        outs = outputs[f"r{i}"]
        assert not outs[-1].error
        assert outs[0].new_token_ids and all(o.prompt_logprobs is None for o in outs[1:])
        _close(outs[0].prompt_logprobs, want)
    assert all(o.prompt_logprobs is None for o in outputs["plain"])
    assert _all_blocks_free(llm.engine)


def test_a_request_with_prompt_logprobs_takes_no_prefix_cache_hits_but_leaves_its_blocks(make_llm, alone):
    llm = make_llm(cache={"num_blocks": 64, "block_size": BLOCK_SIZE, "enable_prefix_caching": True})
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    scored = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    (first,), (again,), (third,) = (llm.generate([PROMPTS[0]], sp) for sp in (greedy, scored, greedy))
    assert first.prompt_logprobs is None and first.num_cached_tokens == 0
    assert again.num_cached_tokens == 0
    _close(again.prompt_logprobs, alone[0])
    assert third.num_cached_tokens == 64 and third.token_ids == first.token_ids == again.token_ids
    # its own full blocks are cached for the requests that follow
    (scored_first,), (after,) = (llm.generate([PROMPTS[1]], sp) for sp in (scored, greedy))
    _close(scored_first.prompt_logprobs, alone[1])
    assert after.num_cached_tokens == 32
    assert _all_blocks_free(llm.engine)


def test_a_continuation_is_sent_no_prompt_logprobs(make_llm):
    """Its client got them with the first output, from the instance that served it first."""
    llm = make_llm(cache={"block_size": BLOCK_SIZE})
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    whole = _run(llm.engine, [Request("whole", PROMPTS[2], params)])["whole"]
    assert whole[0].prompt_logprobs is not None
    delivered = [t for o in whole[:3] for t in o.new_token_ids]
    rest = _run(llm.engine, [Request("cont", PROMPTS[2], params, output_token_ids=delivered)])["cont"]
    assert [t for o in rest for t in o.new_token_ids] == [t for o in whole[3:] for t in o.new_token_ids]
    assert all(o.prompt_logprobs is None for o in rest)
    assert _all_blocks_free(llm.engine)
