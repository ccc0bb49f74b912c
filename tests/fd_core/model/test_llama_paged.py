"""Greedy outputs of the paged Llama do not depend on batching, chunking or block layout."""

from __future__ import annotations

import numpy as np
import pytest

from fd_core.model.llama import LlamaForCausalLM
from fd_core.outputs import ScheduledRequest, StepPlan
from fd_core.request import Request
from fd_core.runner.model_runner import ModelRunner
from fd_plugins.models.llama import LlamaFamily
from tests.fd_core.model.tiny_llama import GreedySampler, random_weights, tiny_arch

PROMPT_LENS = (5, 17, 40, 70, 131)
MAX_NEW = 12
NUM_BLOCKS = 48


def _prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(7)
    return {f"r{i}": rng.integers(0, 256, n).tolist() for i, n in enumerate(PROMPT_LENS)}


def _block_tables(block_size: int, seed: int) -> dict[str, list[int]]:
    """Non-contiguous, shuffled block ids; block 0 is never handed out."""
    pool = list(np.random.default_rng(seed).permutation(np.arange(1, NUM_BLOCKS)))
    tables = {}
    for i, n in enumerate(PROMPT_LENS):
        need = -(-(n + MAX_NEW) // block_size)
        tables[f"r{i}"] = [int(pool.pop()) for _ in range(need)]
    return tables


def _runner(block_size: int, sampler: GreedySampler | None = None) -> ModelRunner:
    arch = tiny_arch()
    return ModelRunner(LlamaFamily(), arch, random_weights(arch), num_blocks=NUM_BLOCKS, block_size=block_size,
                       sampler=sampler or GreedySampler())


def _generate(runner: ModelRunner, tables: dict[str, list[int]], *, chunk: int | None,
              groups: list[list[str]], arrivals: dict[str, int] | None = None,
              plans: list[StepPlan] | None = None) -> dict[str, list[int]]:
    """Drive the runner like a scheduler: each group runs to completion, its requests batched.

    A request joins its group's batch at step ``arrivals[id]`` (default 0); each step it
    computes up to ``chunk`` of its uncomputed tokens and samples when it reaches the end.
    """
    prompts = _prompts()
    outputs = {}
    for group in groups:
        reqs = [Request(rid, prompts[rid]) for rid in group]
        step = 0
        while any(len(r.output_token_ids) < MAX_NEW for r in reqs):
            rows = []
            for r in reqs:
                if len(r.output_token_ids) >= MAX_NEW or step < (arrivals or {}).get(r.request_id, 0):
                    continue
                todo = r.num_tokens - r.num_computed_tokens
                n = min(todo, chunk or todo)
                rows.append(ScheduledRequest(r, r.num_computed_tokens, n, tables[r.request_id],
                                             sample=n == todo))
            plan = StepPlan(rows, total_num_tokens=sum(row.num_new_tokens for row in rows))
            if plans is not None:
                plans.append(plan)
            result = runner.execute(plan) if rows else None
            for row in rows:
                row.request.num_computed_tokens += row.num_new_tokens
                if row.sample:
                    row.request.output_token_ids.append(result.sampled[row.request.request_id].token_id)
            step += 1
        outputs.update({r.request_id: r.output_token_ids for r in reqs})
    return outputs


@pytest.fixture(scope="module")
def reference() -> tuple[dict[str, list[int]], GreedySampler]:
    """Each request alone, whole prompt in one step, block size 16."""
    sampler = GreedySampler()
    runner = _runner(16, sampler)
    out = _generate(runner, _block_tables(16, seed=1), chunk=None, groups=[[r] for r in _prompts()])
    assert all(len(set(tokens)) > 2 for tokens in out.values()), "greedy output is degenerate"
    return out, sampler


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("mode", ["alone", "batched", "chunked", "staggered"])
def test_outputs_match_reference(reference, block_size: int, mode: str) -> None:
    expected, ref_sampler = reference
    sampler = GreedySampler()
    runner = _runner(block_size, sampler)
    tables = _block_tables(block_size, seed=block_size + len(mode))
    everyone = [list(_prompts())]
    plans: list[StepPlan] = []
    if mode == "alone":
        out = _generate(runner, tables, chunk=None, groups=[[r] for r in _prompts()])
    elif mode == "batched":
        out = _generate(runner, tables, chunk=None, groups=everyone, plans=plans)
    elif mode == "chunked":
        out = _generate(runner, tables, chunk=7, groups=everyone, plans=plans)
    else:  # later arrivals prefill in chunks while earlier ones decode
        arrivals = {rid: 3 * i for i, rid in enumerate(_prompts())}
        out = _generate(runner, tables, chunk=7, groups=everyone, arrivals=arrivals, plans=plans)
        assert any(any(r.num_new_tokens == 1 for r in p.scheduled)
                   and any(r.num_new_tokens > 1 for r in p.scheduled) for p in plans)
    assert out == expected
    for rid, rows in ref_sampler.logits.items():
        np.testing.assert_allclose(np.stack(sampler.logits[rid]), np.stack(rows), atol=1e-4, rtol=1e-4)


def test_cache_written_in_place_and_only_in_assigned_blocks() -> None:
    runner = _runner(16)
    tables = _block_tables(16, seed=3)
    pointers = [(c.key.data_ptr(), c.value.data_ptr()) for c in runner.kv_caches]
    _generate(runner, tables, chunk=7, groups=[list(_prompts())])
    assert pointers == [(c.key.data_ptr(), c.value.data_ptr()) for c in runner.kv_caches]
    # The last sampled token is never computed, so only n + MAX_NEW - 1 positions are cached.
    used = sorted({b for i, t in enumerate(tables.values())
                   for b in t[:-(-(PROMPT_LENS[i] + MAX_NEW - 1) // 16)]})
    unused = sorted(set(range(NUM_BLOCKS)) - set(used))
    for cache in runner.kv_caches:
        key = cache.key.numpy()
        assert not key[unused].any()
        assert key[used].any(axis=(1, 2, 3)).all()


def test_release_forgets_sampler_state() -> None:
    sampler = GreedySampler()
    _runner(16, sampler).release(["a", "b"])
    assert sampler.forgotten == ["a", "b"]


def test_bad_rows_rejected_before_cache_is_touched() -> None:
    runner = _runner(16)
    req = Request("x", list(range(40)))
    with pytest.raises(ValueError, match="cannot hold 40 tokens"):
        runner.execute(StepPlan([ScheduledRequest(req, 0, 40, [1, 2], sample=True)]))
    with pytest.raises(ValueError, match="outside"):
        runner.execute(StepPlan([ScheduledRequest(req, 0, 40, [1, 2, NUM_BLOCKS], sample=True)]))
    long = Request("y", list(range(513)))
    with pytest.raises(ValueError, match="513 tokens, beyond max_position_embeddings=512"):
        runner.execute(StepPlan([ScheduledRequest(long, 0, 513, list(range(1, 34)), sample=True)]))
    assert not any(c.key.numpy().any() for c in runner.kv_caches)


def test_no_sampling_rows_returns_empty_result() -> None:
    runner = _runner(16)
    req = Request("x", list(range(40)))
    result = runner.execute(StepPlan([ScheduledRequest(req, 0, 20, [4, 2, 7], sample=False)]))
    assert result.sampled == {}
    assert runner.kv_caches[0].key.numpy()[[4, 2]].any()


def test_missing_or_misshapen_weights_rejected() -> None:
    arch = tiny_arch()
    weights = random_weights(arch)
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="1 weights missing.*layers.1.mlp.up_proj"):
        LlamaForCausalLM(arch, weights)
    weights = random_weights(arch)
    weights["model.norm.weight"] = weights["model.norm.weight"][:-1]
    with pytest.raises(ValueError, match=r"model.norm.weight: \(63,\) != \(64,\)"):
        LlamaForCausalLM(arch, weights)
