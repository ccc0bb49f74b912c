"""Tests for the v0 resource manager: whole-prompt admission by lifetime blocks, growth, no preemption."""

from __future__ import annotations

from typing import Any

from fd_core.contracts.resource_manager import KVLimits
from fd_core.registry import Registry
from fd_core.request import FinishReason, RequestStatus
from fd_core.testing.conformance import check_resource_manager
from fd_plugins.resource_managers.v0 import V0ResourceManager, V0Settings


def _v0(hooks: Any, *, settings: V0Settings | None = None, **overrides: Any) -> V0ResourceManager:
    limits = dict(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    limits.update(overrides)
    return V0ResourceManager(settings, limits=KVLimits(**limits), hooks=hooks)


def test_registered_under_its_entry_point():
    assert Registry.discover().load("resource_manager", "v0") is V0ResourceManager


def test_admits_only_when_prompt_plus_max_tokens_fit_beside_promises(hooks, make_request, step):
    rm = _v0(hooks)
    a = make_request("a", 4, max_tokens=8)   # 3 lifetime blocks: 2 now, 1 promised
    b = make_request("b", 2, max_tokens=2)   # 1 block
    c = make_request("c", 2, max_tokens=2)   # 1 block: only a promised one is free
    for r in (a, b, c):
        rm.add_request(r)
    plan = step(rm)
    assert [(r.request.request_id, r.num_new_tokens) for r in plan.scheduled] == [("a", 4), ("b", 2)]
    assert rm.num_free_blocks() == 1 and c.status is RequestStatus.WAITING
    step(rm)                                 # b reaches max_tokens and frees its block
    assert b.status is RequestStatus.FINISHED
    assert [r.request.request_id for r in step(rm).scheduled] == ["a", "c"]
    while rm.has_unfinished():
        assert step(rm).preempted_ids == []
    assert rm.num_free_blocks() == 4 and rm.stats().num_preemptions == 0


def test_decode_grows_one_block_at_each_boundary(hooks, make_request, step):
    rm = _v0(hooks, settings=V0Settings(reserved_decode_blocks=0), num_blocks=8)
    rm.add_request(make_request("a", 4, max_tokens=10))
    sizes = []
    while rm.has_unfinished():
        plan = step(rm)
        sizes.append(len(plan.scheduled[0].block_table))
    # computes tokens 0-3, then 4, 5, ..., 12: a block more at positions 4 and 8 and 12
    assert sizes == [1, 2, 2, 2, 2, 3, 3, 3, 3, 4]


def test_a_prompt_longer_than_the_budget_gets_a_step_of_its_own(hooks, make_request, step):
    rm = _v0(hooks, num_blocks=16, max_num_batched_tokens=8, enable_chunked_prefill=True)
    short = make_request("short", 3, max_tokens=10)
    rm.add_request(short)
    step(rm)
    rm.add_request(make_request("long", 12, max_tokens=2))
    plan = step(rm)
    assert [(r.request.request_id, r.num_new_tokens) for r in plan.scheduled] == [("long", 12)]
    assert [(r.request.request_id, r.num_new_tokens) for r in step(rm).scheduled] == [("short", 1), ("long", 1)]


def test_abort_releases_blocks_and_promises(hooks, make_request):
    rm = _v0(hooks)
    a, b = make_request("a", 4, max_tokens=8), make_request("b", 4, max_tokens=8)
    rm.add_request(a)
    rm.add_request(b)
    assert [r.request for r in rm.schedule().scheduled] == [a]   # b needs 3 blocks, 1 is unpromised
    rm.finish_requests([a], FinishReason.ABORT)
    assert rm.num_free_blocks() == 4
    assert [r.request for r in rm.schedule().scheduled] == [b]


def test_never_preempts_on_a_tiny_pool(hooks):
    limits = KVLimits(num_blocks=6, block_size=2, max_num_seqs=4, max_num_batched_tokens=12, max_model_len=12)
    report = check_resource_manager(lambda lim: V0ResourceManager(None, limits=lim, hooks=hooks), seed=3,
                                    limits=limits, num_requests=40, allow_lone_oversized_prompt=True)
    assert report.num_preemptions == 0 and report.steps > 0
