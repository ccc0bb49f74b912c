"""The scheduler kit: every built-in passes, each broken scheduler fails naming its invariant."""

from __future__ import annotations

import time
from typing import Any

import pytest

from fd_core.request import Request
from fd_core.testing.conformance import (
    SCHEDULER_CHECKS,
    ConformanceError,
    check_scheduler,
    directory_scheduler,
    run_scheduler_checks,
)
from fd_plugins.schedulers.local import LocalScheduler
from fd_plugins.schedulers.pool.scheduler import GlobalScheduler
from fd_plugins.schedulers.splitwise import SplitwiseScheduler


def _only(*names: str) -> set[str]:
    return {c.name for c in SCHEDULER_CHECKS} - set(names)


def test_local_passes_and_is_no_peer_directory():
    report = check_scheduler(LocalScheduler)
    assert report.ok and report.result("peer_directory").status == "skipped"
    assert report.result("ttl_expiry").status == "passed"


def test_a_factory_works_like_the_class():
    report = check_scheduler(lambda hooks, max_queue_size: LocalScheduler(None, hooks=hooks,
                                                                          max_queue_size=max_queue_size))
    assert report.ok and report.plugin.endswith("<lambda>")


def test_the_kits_in_memory_peer_directory_passes_every_check():
    report = check_scheduler(directory_scheduler(LocalScheduler))
    assert all(r.status == "passed" for r in report.results), report


def test_splitwise_passes_with_redis(redis_server):
    report = check_scheduler(SplitwiseScheduler, options={"url": redis_server.url, "heartbeat_s": 0.1,
                                                          "lease_s": 1.0})
    assert all(r.status == "passed" for r in report.results), report


def test_global_passes_with_redis(redis_server):
    options = {"url": redis_server.url, "heartbeat_s": 0.1, "socket_timeout_s": 0.4, "lease_s": 1.0}
    report = check_scheduler(GlobalScheduler, options=options)
    assert {r.check: r.status for r in report.results if r.status != "passed"} == {"peer_directory": "skipped"}


def test_a_scheduler_that_drops_a_request_is_caught(broken_plugins):
    with pytest.raises(ConformanceError) as caught:
        check_scheduler(broken_plugins.scheduler.DropsRequests, skip=_only("exactly_once"))
    assert str(caught.value) == ("scheduler invariant 'handed out exactly once or answered' broken: request 'r7' "
                                 "was never handed out nor answered (seed 0)")
    assert caught.value.invariant == "handed out exactly once or answered"


class _Spins(LocalScheduler):
    def get_requests(self, max_num: int, timeout: float | None) -> list[Request]:
        deadline = time.monotonic() + (timeout or 0)
        while time.monotonic() < deadline:
            got = super().get_requests(max_num, 0)
            if got:
                return got
        return []


class _ReturnsAtOnce(LocalScheduler):
    def get_requests(self, max_num: int, timeout: float | None) -> list[Request]:
        return super().get_requests(max_num, 0)


class _DeafToWake(LocalScheduler):
    def wake(self) -> None:
        pass


class _IgnoresHooks(LocalScheduler):
    def __init__(self, settings: Any, *, hooks: Any, max_queue_size: int) -> None:
        super().__init__(settings, hooks=None, max_queue_size=max_queue_size)


class _NeverFull(LocalScheduler):
    def put_request(self, request: Request) -> None:
        self.max_queue_size = 10**9
        super().put_request(request)


class _NewestResultFirst(LocalScheduler):
    def get_results(self, timeout: float | None) -> list[Any]:
        return super().get_results(timeout)[::-1]


class _AbortForgets(LocalScheduler):
    def _answer(self, request: Request, reason: Any, error: Any) -> None:
        pass   # aborted and expired requests just vanish


class _Duplicates(LocalScheduler):
    again = True

    def get_requests(self, max_num: int, timeout: float | None) -> list[Request]:
        got = super().get_requests(max_num, timeout)
        for request in got:
            if request.request_id == "r3" and self.again:
                self.again = False
                self._waiting.append(request)   # hands it out a second time later
        return got


class _NoLock(LocalScheduler):
    """Takes requests without the lock, slowly: two getters hand out the same one."""

    def get_requests(self, max_num: int, timeout: float | None) -> list[Request]:
        if not self._waiting:
            time.sleep(timeout or 0)
            return []
        taken = self._waiting[:max_num]
        time.sleep(0.001)
        del self._waiting[:len(taken)]
        return taken


@pytest.mark.parametrize(("cls", "check", "message"), [
    (_Spins, "blocks_when_empty", "scheduler invariant 'get_requests blocks without spinning when empty' broken: "
                                  "the thread blocked in get_requests(4, timeout=0.3) used"),
    (_ReturnsAtOnce, "blocks_when_empty", "with nothing queued: an idle engine loop calling it would spin"),
    (_DeafToWake, "wake_releases", "scheduler invariant 'a put or wake() releases a blocked get_requests' broken: "
                                   "get_requests(4, timeout=5) went on blocking 1.5 s after wake()"),
    (_IgnoresHooks, "order_hook", "scheduler invariant 'the fd_order_waiting hook is honoured' broken: handed out "
                                  "['o0', 'o1', 'o2', 'o3', 'o4', 'o5'], but the registered fd_order_waiting hook "
                                  "ordered ['o5', 'o4', 'o3', 'o2', 'o1', 'o0']"),
    (_NeverFull, "queue_full", "scheduler invariant 'put_request raises QueueFullError when max_queue_size are "
                               "queued' broken: put_request of request 5 with max_queue_size=4 did not raise"),
    (_NewestResultFirst, "results_in_order", "scheduler invariant 'results come back once each, in the order put "
                                             "per request' broken: outputs of 'res0' came back as tokens"),
    (_AbortForgets, "abort_queued", "scheduler invariant 'abort answers a queued request, which is never handed "
                                    "out' broken: the aborted queued request 'ab1' got no final output"),
    (_AbortForgets, "ttl_expiry", "scheduler invariant 'expired requests are answered, never handed out' broken: "
                                  "request 'ttl0' waited past ttl_s=0.05 s and got no final output"),
    (_Duplicates, "exactly_once", "scheduler invariant 'handed out exactly once or answered' broken: request 'r3' "
                                  "was handed out 2 times (seed 0)"),
    (_NoLock, "concurrent", "scheduler invariant 'thread-safe: concurrent puts and gets hand each request out "
                            "once' broken: "),
])
def test_each_broken_scheduler_fails_naming_its_invariant(cls, check, message):
    report = run_scheduler_checks(cls, skip=_only(check))
    [failure] = report.failures
    assert failure.check == check and message in failure.reason, failure.reason
