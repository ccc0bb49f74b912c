"""The local request scheduler: FIFO, the ordering hook, size limit, TTL, abort, blocking."""

from __future__ import annotations

import threading
import time

import pytest

import fd_core
from fd_core.errors import QueueFullError
from fd_core.registry import Registry
from fd_core.request import FinishReason, Request
from fd_plugins.schedulers.local import LocalScheduler, LocalSchedulerSettings, fair_fifo


def _scheduler(general=(), **settings) -> LocalScheduler:
    hooks = Registry.from_plugins({}, general=general).hooks
    return LocalScheduler(LocalSchedulerSettings(**settings), hooks=hooks, max_queue_size=3)


def _request(rid: str, priority: int = 0, age: float = 0.0) -> Request:
    return Request(rid, [1, 2, 3], priority=priority, arrival_time=time.time() - age)


def test_fifo_by_default_and_max_num_respected():
    s = _scheduler()
    for rid in "abc":
        s.put_request(_request(rid))
    assert [r.request_id for r in s.get_requests(2, timeout=0)] == ["a", "b"]
    assert [r.request_id for r in s.get_requests(5, timeout=0)] == ["c"]


def test_ordering_hook_decides_admission_order():
    class ByPriority:
        fd_hookspec_version = fd_core.FD_HOOKSPEC_VERSION

        @fd_core.hookimpl
        def fd_order_waiting(self, waiting, now):
            return sorted(waiting, key=lambda r: r.priority)

    s = _scheduler(general=[ByPriority()])
    for rid, prio in (("low", 5), ("high", 0), ("mid", 2)):
        s.put_request(_request(rid, prio))
    assert [r.request_id for r in s.get_requests(3, timeout=0)] == ["high", "mid", "low"]


def test_full_queue_is_a_clear_error_and_loses_nothing():
    s = _scheduler()
    for rid in "abc":
        s.put_request(_request(rid))
    with pytest.raises(QueueFullError, match=r"request queue is full: 3 waiting, the most "
                       r"server.max_queue_size \(3\) allows"):
        s.put_request(_request("d"))
    assert s.num_waiting() == 3


def test_expired_requests_are_answered_not_run():
    s = _scheduler(ttl_s=1.0)
    s.put_request(_request("old", age=5.0))
    s.put_request(_request("new"))
    assert [r.request_id for r in s.get_requests(5, timeout=0)] == ["new"]
    (answer,) = s.get_results(timeout=0)
    assert answer.request_id == "old" and answer.finished and answer.finish_reason is FinishReason.ERROR
    assert "expired" in answer.error


def test_abort_of_a_queued_request_answers_it():
    s = _scheduler()
    s.put_request(_request("a"))
    assert s.abort("a") and not s.abort("a")
    (answer,) = s.get_results(timeout=0)
    assert answer.finish_reason is FinishReason.ABORT
    assert s.get_requests(5, timeout=0) == []


def test_get_requests_blocks_until_a_request_arrives_or_wake():
    s = _scheduler()
    got = []
    waiter = threading.Thread(target=lambda: got.extend(s.get_requests(5, timeout=None)))
    waiter.start()
    time.sleep(0.1)
    assert waiter.is_alive()          # blocked, not spinning out
    s.put_request(_request("x"))
    waiter.join(5)
    assert [r.request_id for r in got] == ["x"]
    waiter = threading.Thread(target=lambda: s.get_requests(5, timeout=None))
    waiter.start()
    s.wake()
    waiter.join(5)
    assert not waiter.is_alive()


def test_siblings_of_one_call_take_turns_with_other_calls():
    s = LocalScheduler(LocalSchedulerSettings(), hooks=Registry.from_plugins({}).hooks, max_queue_size=100)
    for i in range(6):                                     # one call with n=6
        s.put_request(Request(f"big-{i}", [1, 2], group_id="big"))
    s.put_request(Request("small", [1, 2], group_id="small"))
    s.put_request(Request("alone", [1, 2]))                # no group: a group of one
    first = [r.request_id for r in s.get_requests(3, timeout=0)]
    assert first == ["big-0", "small", "alone"]
    assert [r.request_id for r in s.get_requests(10, timeout=0)] == [f"big-{i}" for i in range(1, 6)]


def test_fair_fifo_keeps_arrival_order_within_a_group_and_between_groups():
    a = [Request(f"a{i}", [1], group_id="a") for i in range(3)]
    b = [Request(f"b{i}", [1], group_id="b") for i in range(2)]
    c = Request("c", [1])
    order = fair_fifo([a[0], a[1], b[0], a[2], c, b[1]])
    assert [r.request_id for r in order] == ["a0", "b0", "c", "a1", "b1", "a2"]
    singles = [Request(str(i), [1]) for i in range(4)]
    assert fair_fifo(singles) == singles
