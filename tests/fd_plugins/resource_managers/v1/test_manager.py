"""Tests for the v1 resource manager: budget, chunking, preemption, prefix hits and freeing."""

from __future__ import annotations

from typing import Any

from fd_core.contracts.resource_manager import KVLimits
from fd_core.hookspecs import hookimpl
from fd_core.registry import Registry
from fd_core.request import FinishReason, RequestStatus
from fd_plugins.resource_managers.v1.manager import V1ResourceManager, V1Settings


def _v1(hooks: Any, *, settings: V1Settings | None = None, **overrides: Any) -> V1ResourceManager:
    limits = dict(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                  enable_chunked_prefill=True, enable_prefix_caching=True)
    limits.update(overrides)
    return V1ResourceManager(settings, limits=KVLimits(**limits), hooks=hooks)


def test_registered_under_its_entry_point():
    assert Registry.discover().load("resource_manager", "v1") is V1ResourceManager


def test_first_step_plans_the_prompt_and_advances_computed_tokens(hooks, make_request):
    rm = _v1(hooks)
    req = make_request("a", 10)
    rm.add_request(req)
    plan = rm.schedule()
    (row,) = plan.scheduled
    assert (row.start, row.num_new_tokens, row.sample, len(row.block_table)) == (0, 10, True, 3)
    assert req.num_computed_tokens == 10 and req.status is RequestStatus.RUNNING
    assert req.scheduled_time is not None and plan.total_num_tokens == 10
    first = req.scheduled_time
    req.output_token_ids.append(1)
    (row,) = rm.schedule().scheduled
    assert (row.start, row.num_new_tokens, row.sample) == (10, 1, True) and req.scheduled_time == first


def test_chunked_prefill_keeps_every_step_within_the_budget(hooks, make_request, step):
    rm = _v1(hooks, max_num_batched_tokens=8, num_blocks=32)
    long, short = make_request("long", 30, max_tokens=2), make_request("short", 5, max_tokens=2)
    rm.add_request(long)
    rm.add_request(short)
    plans = []
    while rm.has_unfinished():
        plans.append(step(rm))
    assert all(p.total_num_tokens <= 8 for p in plans)
    long_rows = [r for p in plans for r in p.scheduled if r.request is long]
    assert [r.num_new_tokens for r in long_rows[:4]] == [8, 8, 8, 6]
    assert [r.sample for r in long_rows[:4]] == [False, False, False, True]
    assert rm.num_free_blocks() == 32


class _ChunkOfThree:
    @hookimpl
    def fd_prefill_chunk_size(self, request, remaining_prompt, budget):
        return 3


def test_chunk_size_hook_and_threshold(make_request):
    hooks = Registry.from_plugins({}, general=[_ChunkOfThree()]).hooks
    rm = _v1(hooks)
    rm.add_request(make_request("a", 10))
    assert [r.num_new_tokens for r in rm.schedule().scheduled] == [3]
    rm = _v1(Registry.from_plugins({}).hooks, settings=V1Settings(long_prefill_token_threshold=4))
    rm.add_request(make_request("a", 10))
    assert [r.num_new_tokens for r in rm.schedule().scheduled] == [4]


def test_without_chunked_prefill_a_prompt_waits_for_room_unless_it_never_fits(hooks, make_request):
    rm = _v1(hooks, enable_chunked_prefill=False, max_num_batched_tokens=16, enable_prefix_caching=False)
    a, b = make_request("a", 10), make_request("b", 10)
    rm.add_request(a)
    rm.add_request(b)
    assert [(r.request.request_id, r.num_new_tokens) for r in rm.schedule().scheduled] == [("a", 10)]
    a.output_token_ids.append(1)
    assert [(r.request.request_id, r.num_new_tokens) for r in rm.schedule().scheduled] == [("a", 1), ("b", 10)]
    rm = _v1(hooks, enable_chunked_prefill=False, max_num_batched_tokens=16, enable_prefix_caching=False)
    rm.add_request(make_request("huge", 30))
    assert [r.num_new_tokens for r in rm.schedule().scheduled] == [16]
    assert [r.num_new_tokens for r in rm.schedule().scheduled] == [14]


def _two_running(hooks: Any, make_request: Any, step: Any) -> V1ResourceManager:
    """Pool of 4 blocks, both requests hold 2 and reach their 9th token in the same step."""
    rm = _v1(hooks, num_blocks=4, enable_prefix_caching=False)
    for rid in "ab":
        rm.add_request(make_request(rid, 6, max_tokens=8))
    for _ in range(3):
        assert step(rm).preempted_ids == []
    return rm


def test_preemption_takes_the_last_admitted_by_recompute(hooks, make_request, step):
    rm = _two_running(hooks, make_request, step)
    a, b = rm.running
    plan = step(rm)
    assert plan.preempted_ids == ["b"] and [r.request for r in plan.scheduled] == [a]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert rm.waiting[0] is b and rm.stats().num_preemptions == 1
    while rm.has_unfinished():
        step(rm)
    assert rm.num_free_blocks() == 4 and len(b.output_token_ids) == 8


class _OldestVictim:
    def __init__(self) -> None:
        self.calls: list[tuple[list[str], str]] = []

    @hookimpl
    def fd_select_preemption_victim(self, running, needed_by):
        self.calls.append(([r.request_id for r in running], needed_by.request_id))
        return running[0]


def test_victim_hook_is_honoured_even_when_it_picks_the_needy_request(make_request, step):
    victim_hook = _OldestVictim()
    rm = _two_running(Registry.from_plugins({}, general=[victim_hook]).hooks, make_request, step)
    plan = step(rm)
    assert victim_hook.calls == [(["a", "b"], "a")]
    assert plan.preempted_ids == ["a"] and [r.request.request_id for r in plan.scheduled] == ["b"]


def test_preempting_an_already_scheduled_request_drops_its_row_and_refunds_budget(make_request):
    rm = _v1(Registry.from_plugins({}, general=[_OldestVictim()]).hooks, num_blocks=3,
             enable_prefix_caching=False)
    a, b = make_request("a", 5), make_request("b", 4)
    rm.add_request(a)
    rm.add_request(b)
    assert rm.schedule().total_num_tokens == 9
    a.output_token_ids.append(1)
    b.output_token_ids.append(1)
    plan = rm.schedule()   # a fits its 2 blocks; b needs a 2nd block and the hook takes a
    assert plan.preempted_ids == ["a"] and [r.request for r in plan.scheduled] == [b]
    assert plan.total_num_tokens == 1 and a.num_computed_tokens == 0


class _BadVictim:
    @hookimpl
    def fd_select_preemption_victim(self, running, needed_by):
        return object()


class _RaisingChunk:
    @hookimpl
    def fd_prefill_chunk_size(self, request, remaining_prompt, budget):
        raise RuntimeError("chunk hook bug")


def test_a_victim_that_is_not_running_is_reported_once_and_the_default_is_used(make_request, step, caplog):
    rm = _two_running(Registry.from_plugins({}, general=[_BadVictim()]).hooks, make_request, step)
    plan = step(rm)
    assert plan.preempted_ids == ["b"]   # the default: the last admitted
    step(rm)
    reports = [r.getMessage() for r in caplog.records if "fd_select_preemption_victim" in r.getMessage()]
    assert len(reports) == 1 and "is not one of the running requests" in reports[0]


def test_a_raising_chunk_hook_falls_back_to_the_whole_budget(make_request, caplog):
    rm = _v1(Registry.from_plugins({}, general=[_RaisingChunk()]).hooks)
    request = make_request("a", 20)
    rm.add_request(request)
    (row,) = rm.schedule().scheduled
    assert row.num_new_tokens == 20
    assert any("hook fd_prefill_chunk_size raised RuntimeError: chunk hook bug" in r.getMessage()
               for r in caplog.records)


def test_prefix_hits_share_blocks_and_count_tokens(hooks, make_request, step):
    rm = _v1(hooks)
    first = make_request("a", 9, max_tokens=1)
    rm.add_request(first)
    table_a = step(rm).scheduled[0].block_table
    second = make_request("b", 9, max_tokens=1)
    rm.add_request(second)
    (row,) = rm.schedule().scheduled
    assert (row.start, row.num_new_tokens) == (8, 1) and row.block_table[:2] == table_a[:2]
    assert second.num_cached_tokens == 8
    stats = rm.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18, 8)


def test_full_hit_recomputes_the_last_block_and_other_prefixes_miss(hooks, make_request, step):
    rm = _v1(hooks)
    rm.add_request(make_request("a", 8, max_tokens=1))
    step(rm)
    same = make_request("same", 8)
    other = make_request("other", [5, *list(range(1, 8))])
    rm.add_request(same)
    rm.add_request(other)
    starts = {r.request.request_id: r.start for r in rm.schedule().scheduled}
    assert starts == {"same": 4, "other": 0}


def test_blocks_of_a_failed_step_are_not_cached(hooks, make_request):
    rm = _v1(hooks)
    failed = make_request("a", 9)
    rm.add_request(failed)
    rm.schedule()
    rm.finish_requests([failed], FinishReason.ERROR)
    assert not rm.has_unfinished() and failed.status is not RequestStatus.FINISHED  # the core marks it
    rm.add_request(make_request("b", 9))
    assert rm.schedule().scheduled[0].start == 0


def test_abort_frees_running_and_waiting_requests_at_once(hooks, make_request):
    rm = _v1(hooks, max_num_seqs=1, enable_prefix_caching=False)
    running, waiting = make_request("r", 10), make_request("w", 10)
    rm.add_request(running)
    rm.add_request(waiting)
    rm.schedule()
    assert rm.num_free_blocks() == 13
    rm.finish_requests([running], FinishReason.ABORT)
    assert rm.num_free_blocks() == 16 and rm.stats().num_running == 0
    rm.finish_requests([waiting], FinishReason.ABORT)
    rm.finish_requests([waiting, make_request("nope", 3)], FinishReason.ABORT)   # unknown or ended: ignored
    assert not rm.has_unfinished() and rm.stats().num_waiting == 0 and rm.num_free_blocks() == 16


def test_max_num_seqs_caps_running_requests(hooks, make_request):
    rm = _v1(hooks, max_num_seqs=2)
    for i in range(4):
        rm.add_request(make_request(f"r{i}", 3))
    plan = rm.schedule()
    assert len(plan.scheduled) == 2 and rm.stats().num_waiting == 2


def _choice(make_request: Any, call: str, index: int, prompt: int = 6, max_tokens: int = 8) -> Any:
    request = make_request(f"{call}{index}", prompt, max_tokens=max_tokens)
    request.group_id = call
    return request


def test_the_default_victim_is_the_last_admitted_choice_of_the_call_running_most(hooks, make_request, step):
    """A single request admitted after a large-n call's choices is not their victim (issue 41 item 20)."""
    rm = _v1(hooks, num_blocks=6, enable_prefix_caching=False)
    big = [_choice(make_request, "big", i) for i in range(2)]
    small = make_request("small", 6, max_tokens=8)
    for request in (*big, small):
        rm.add_request(request)
    for _ in range(3):                     # each holds 2 blocks; all three reach their 9th token at once
        assert step(rm).preempted_ids == []
    plan = step(rm)
    assert plan.preempted_ids == ["big1"] and small in [row.request for row in plan.scheduled]


def test_waiting_requests_of_the_call_running_fewest_are_admitted_first(hooks, make_request):
    """Calls take turns: a large-n call's waiting choices do not stay ahead of another call's request."""
    rm = _v1(hooks, max_num_seqs=3)
    choices = [_choice(make_request, "big", i, prompt=3) for i in range(4)]
    small = make_request("small", 3)
    for request in (*choices, small):
        rm.add_request(request)
    planned = [row.request.request_id for row in rm.schedule().scheduled]
    assert planned == ["big0", "small", "big1"]   # big0 runs, so small (its call runs none) goes next


def test_a_call_running_none_gets_blocks_from_the_call_running_most(hooks, make_request, step):
    """A large-n call's choices holding every block do not keep another call's request out."""
    rm = _v1(hooks, num_blocks=4, enable_prefix_caching=False)
    big = [_choice(make_request, "big", i) for i in range(2)]
    for request in big:
        rm.add_request(request)
    step(rm)                               # each choice holds 2 blocks: the pool is dry
    small = make_request("small", 3, max_tokens=2)
    rm.add_request(small)
    plan = step(rm)
    assert plan.preempted_ids == ["big1"] and [row.request for row in plan.scheduled] == [big[0], small]
    assert plan.total_num_tokens == 1 + 3
    while rm.has_unfinished():
        step(rm)
    assert rm.num_free_blocks() == 4 and all(len(r.output_token_ids) == 8 for r in big)


def test_a_single_request_never_preempts_another_to_be_admitted(hooks, make_request, step):
    rm = _v1(hooks, num_blocks=4, enable_prefix_caching=False)
    for rid in "ab":
        rm.add_request(make_request(rid, 6, max_tokens=8))
    step(rm)
    rm.add_request(make_request("c", 3))
    plan = step(rm)
    assert plan.preempted_ids == [] and rm.waiting[0].request_id == "c"
