"""Greedy outputs of batched engine runs equal one-request-at-a-time generation."""

from __future__ import annotations

import numpy as np
import pytest

from fd_core.request import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _prompts(n: int, *, seed: int = 0, shared_prefix: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    prefix = rng.integers(3, 500, shared_prefix).tolist()
    return [prefix + rng.integers(3, 500, int(rng.integers(5, 90))).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """Each prompt alone through a fresh v1 engine with no prefix cache: the baseline."""
    from fd_core.engine.llm import LLM

    llm = LLM(model=tiny_model_dir, cache={"num_blocks": 256, "enable_prefix_caching": False},
              engine={"max_num_seqs": 1, "max_num_batched_tokens": 512})
    cache = {}

    def alone(prompts):
        out = []
        for p in prompts:
            key = tuple(p)
            if key not in cache:
                cache[key] = llm.generate([p], GREEDY)[0].token_ids
            out.append(cache[key])
        return out

    return alone


def _batched(llm, prompts):
    results = llm.generate(prompts, GREEDY)
    assert all(r.finished and len(r.token_ids) == GREEDY.max_tokens for r in results)
    return [r.token_ids for r in results]


def _all_blocks_free(llm):
    stats = llm.engine.resource_manager.stats()
    return stats.num_free_blocks == stats.num_blocks and stats.num_running == 0 and stats.num_waiting == 0


def test_v0_matches_one_at_a_time(make_llm, reference):
    prompts = _prompts(10, seed=1)
    llm = make_llm(resource_manager={"name": "v0"})
    assert _batched(llm, prompts) == reference(prompts)
    assert _all_blocks_free(llm)


def test_v1_matches_one_at_a_time(make_llm, reference):
    prompts = _prompts(10, seed=2)
    llm = make_llm(resource_manager={"name": "v1"}, cache={"enable_prefix_caching": False})
    assert _batched(llm, prompts) == reference(prompts)
    assert _all_blocks_free(llm)


def test_v1_chunked_prefill_with_small_budget_matches(make_llm, reference):
    prompts = _prompts(8, seed=3)
    llm = make_llm(engine={"max_num_batched_tokens": 16, "max_num_seqs": 8},
                   cache={"enable_prefix_caching": False})
    assert _batched(llm, prompts) == reference(prompts)
    assert llm.engine.stats().num_steps > sum(len(p) for p in prompts) // 16  # prompts really were chunked
    assert _all_blocks_free(llm)


def test_v1_prefix_cache_hits_and_matches(make_llm, reference):
    prompts = _prompts(8, seed=4, shared_prefix=64)
    llm = make_llm(cache={"enable_prefix_caching": True, "block_size": 16})
    first = _batched(llm, prompts[:1])          # fills the cache with the shared prefix
    rest = _batched(llm, prompts[1:])
    assert first + rest == reference(prompts)
    stats = llm.engine.resource_manager.stats()
    assert stats.prefix_cache_hits >= 7 * 64     # every later prompt reused the 4 shared blocks
    assert _all_blocks_free(llm)


def test_v1_preemption_under_a_tiny_pool_matches(make_llm, reference):
    prompts = _prompts(8, seed=5)
    llm = make_llm(cache={"num_blocks": 16, "block_size": 16, "enable_prefix_caching": False},
                   engine={"max_num_seqs": 8, "max_num_batched_tokens": 128})
    assert _batched(llm, prompts) == reference(prompts)
    assert llm.engine.resource_manager.stats().num_preemptions > 0
    assert _all_blocks_free(llm)


def test_block_size_64_matches(make_llm, reference):
    prompts = _prompts(6, seed=6)
    llm = make_llm(cache={"block_size": 64, "num_blocks": 64})
    assert _batched(llm, prompts) == reference(prompts)
