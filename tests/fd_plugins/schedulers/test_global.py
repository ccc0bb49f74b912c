"""The ``global`` scheduler against a real redis-server, without a model: two pool members in
this process, driven the way the engine loop drives them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fd_core.errors import ConfigError
from fd_core.outputs import RequestOutput
from fd_core.registry import Registry
from fd_core.request import FinishReason, Request, SamplingParams
from fd_plugins.schedulers.pool.scheduler import GlobalScheduler
from fd_plugins.schedulers.pool.settings import GlobalSchedulerSettings

FAST = {"heartbeat_s": 0.1, "lease_s": 0.4, "poll_s": 0.02, "steal_min_queued": 1}


def _no_hooks() -> Any:
    """A real hook relay with no implementation registered."""
    return Registry.from_plugins({}).hooks


@pytest.fixture
def pool(redis_server: Any) -> Iterator[Callable[..., GlobalScheduler]]:
    made: list[GlobalScheduler] = []

    def member(name: str, **options: Any) -> GlobalScheduler:
        settings = GlobalSchedulerSettings(url=redis_server.url, instance_id=name, **{**FAST, **options})
        scheduler = GlobalScheduler(settings, hooks=_no_hooks(), max_queue_size=64)
        made.append(scheduler)
        return scheduler

    yield member
    for scheduler in made:
        scheduler.close()


def _request(request_id: str) -> Request:
    return Request(request_id, [1, 2, 3], SamplingParams(max_tokens=8))


def _output(request: Request, token: int, *, finished: bool = False) -> RequestOutput:
    request.output_token_ids.append(token)
    return RequestOutput(request.request_id, [token], f"<{token}>", finished=finished,
                         finish_reason=FinishReason.LENGTH if finished else None,
                         num_prompt_tokens=3, num_output_tokens=len(request.output_token_ids))


def _results_until(scheduler: GlobalScheduler, done: Callable[[list[RequestOutput]], bool],
                   timeout: float = 5.0) -> list[RequestOutput]:
    got: list[RequestOutput] = []
    deadline = time.monotonic() + timeout
    while not done(got):
        assert time.monotonic() < deadline, f"results so far: {got}"
        got += scheduler.get_results(timeout=0.1)
    return got


def _take(scheduler: GlobalScheduler, n: int, timeout: float = 3.0) -> list[Request]:
    """get_requests the way the engine loop calls it (again after an early return), until ``n`` came."""
    got: list[Request] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got += scheduler.get_requests(n - len(got), timeout=0.5)
    return got


def test_unreachable_redis_fails_start_up_naming_the_url() -> None:
    settings = GlobalSchedulerSettings(url="redis://127.0.0.1:1/0", socket_timeout_s=0.5)
    with pytest.raises(ConfigError) as info:
        GlobalScheduler(settings, hooks=_no_hooks(), max_queue_size=4)
    assert info.value.key == "scheduler.options.url"
    assert "redis://127.0.0.1:1/0" in str(info.value)


def test_own_queue_first_then_a_peer_takes_the_rest_and_outputs_reach_the_origin(pool) -> None:
    a, b = pool("a"), pool("b")
    for i in range(4):
        a.put_request(_request(f"r{i}"))
    mine = a.get_requests(1, timeout=1)
    assert [r.request_id for r in mine] == ["r0"]
    stolen = _take(b, 3)
    assert sorted(r.request_id for r in stolen) == ["r1", "r2", "r3"]
    for request in stolen:
        b.put_results([_output(request, 7)])
        b.put_results([_output(request, 8, finished=True)])
    a.put_results([_output(mine[0], 5, finished=True)])
    got = _results_until(a, lambda got: sum(o.finished for o in got) == 4)
    by_id: dict[str, list[int]] = {}
    for o in got:
        by_id.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert by_id == {"r0": [5], "r1": [7, 8], "r2": [7, 8], "r3": [7, 8]}
    assert b.get_results(timeout=0) == []   # nothing of A's leaks to B's clients
    time.sleep(0.3)
    assert a.stats()["taken_by_peers"] == 3 and b.stats()["served_for_peers"] == 3
    assert b.stats()["holding_for_peers"] == 0


def test_a_dead_holder_s_request_continues_from_the_delivered_tokens(pool) -> None:
    a, b = pool("a"), pool("b")
    a.put_request(_request("r"))
    (held,) = _take(b, 1)
    b.put_results([_output(held, 11)])
    b.put_results([_output(held, 12)])
    first = _results_until(a, lambda got: sum(len(o.new_token_ids) for o in got) == 2)
    b._stop.set()   # B "dies": no heartbeats, no leave
    b._threads[0].join()
    (again,) = _take(a, 1)      # re-queued at the front of A's queue after lease_s
    assert again.request_id == "r" and again.output_token_ids == [11, 12]
    b.put_results([_output(held, 99)])           # B wakes up late: fenced, nothing reaches A
    a.put_results([_output(again, 13, finished=True)])
    rest = _results_until(a, lambda got: any(o.finished for o in got))
    assert [t for o in first + rest for t in o.new_token_ids] == [11, 12, 13]
    assert b.take_cancelled() == ["r"]
    assert a.stats()["leases_expired"] + b.stats()["leases_expired"] >= 1


def test_an_origin_that_dies_has_its_requests_given_up_by_the_holder(pool) -> None:
    a, b = pool("a"), pool("b")
    a.put_request(_request("r"))
    (held,) = _take(b, 1)
    a._stop.set()   # A "dies"
    for thread in a._threads:
        thread.join()
    deadline = time.monotonic() + 3
    cancelled: list[str] = []
    while not cancelled:
        assert time.monotonic() < deadline
        cancelled = b.take_cancelled()
        time.sleep(0.05)
    assert cancelled == ["r"] and b.stats()["holding_for_peers"] == 0


def test_abort_of_a_request_a_peer_holds_answers_at_once_and_the_peer_drops_it(pool) -> None:
    a, b = pool("a"), pool("b")
    a.put_request(_request("r"))
    (held,) = _take(b, 1)
    assert a.abort("r") is True
    (answer,) = _results_until(a, lambda got: bool(got))
    assert answer.finished and answer.finish_reason is FinishReason.ABORT
    b.put_results([_output(held, 1)])
    assert b.take_cancelled() == ["r"]
    assert a.get_results(timeout=0.3) == []


def test_redis_lost_serves_own_requests_locally_and_rejoins(pool, redis_server) -> None:
    a, b = pool("a"), pool("b")
    a.put_request(_request("queued"))
    a.put_request(_request("held-by-b"))
    a.put_request(_request("third"))
    (mine,) = a.get_requests(1, timeout=1)
    (held,) = _take(b, 1)
    b.put_results([_output(held, 21)])
    _results_until(a, lambda got: bool(got))
    redis_server.stop()
    deadline = time.monotonic() + 5
    while a.stats()["redis_up"] or b.stats()["redis_up"]:
        assert time.monotonic() < deadline, (a.stats(), b.stats())
        time.sleep(0.05)
    assert "unreachable" in a.stats()["degraded_reason"]
    local = {r.request_id: r.output_token_ids for r in a.get_requests(8, timeout=1)}
    assert local == {"held-by-b": [21], "third": []}  # continues after the token A's client has
    assert b.take_cancelled() == ["held-by-b"]
    a.put_request(_request("during"))                 # accepted while degraded
    assert [r.request_id for r in a.get_requests(8, timeout=1)] == ["during"]
    redis_server.start()
    deadline = time.monotonic() + 5
    while not (a.stats()["redis_up"] and b.stats()["redis_up"]):
        assert time.monotonic() < deadline, (a.stats(), b.stats())
        time.sleep(0.05)
    a.put_request(_request("after-1"))
    a.put_request(_request("after-2"))
    assert [r.request_id for r in _take(b, 2)] == ["after-1", "after-2"]
    assert mine.request_id == "queued"


def test_every_setting_is_in_the_multi_instance_page() -> None:
    from pathlib import Path

    page = (Path(__file__).resolve().parents[3] / "docs" / "multi-instance.md").read_text()
    missing = [name for name in GlobalSchedulerSettings.model_fields if f"| `{name}` |" not in page]
    assert not missing, f"docs/multi-instance.md lacks the settings {missing}"


def test_undecodable_entries_fail_only_their_request_and_stop_no_thread(pool, redis_server) -> None:
    """A request payload that does not decode is answered with an error naming the member that
    took it; the other requests of the same take reach the engine. An undecodable output routed to
    an origin is dropped, and its result thread goes on delivering."""
    import redis

    a, b = pool("a"), pool("b")
    for request_id in ("good", "bad", "also-good"):
        a.put_request(_request(request_id))
    client = redis.Redis.from_url(redis_server.url)
    client.hset(f"{a._store.prefix}:r:bad", "req", b"\xc1 not msgpack")
    client.rpush(f"{a._store.prefix}:out:a", b"\xc1 not msgpack either")
    stolen = _take(b, 2)
    assert sorted(r.request_id for r in stolen) == ["also-good", "good"]
    failed = _results_until(a, lambda got: any(o.request_id == "bad" for o in got))
    (error,) = [o for o in failed if o.request_id == "bad"]
    assert error.finished and error.finish_reason == FinishReason.ERROR and "'b' could not decode" in error.error
    for request in stolen:   # a's result thread survived the bad output: later outputs still arrive
        b.put_results([_output(request, 7, finished=True)])
    done = _results_until(a, lambda got: sum(o.finished for o in got) == 2)
    assert sorted(o.request_id for o in done if o.finished) == ["also-good", "good"]
    assert a.stats()["undecodable"] == 1 and b.stats()["undecodable"] == 1


def test_a_second_live_member_with_the_same_instance_id_is_refused(pool) -> None:
    """Two members given one id would take each other's requests as their own and drop them."""
    first = pool("same")
    with pytest.raises(ConfigError) as info:
        pool("same")
    assert info.value.key == "scheduler.options.instance_id"
    assert "'same' belongs to another live member" in str(info.value)
    first.put_request(_request("r"))   # the first is untouched
    assert [r.request_id for r in _take(first, 1)] == ["r"]


def test_a_restarted_member_takes_its_id_back_once_the_dead_claim_runs_out(pool) -> None:
    """A restart within lease_s (a supervisor after a crash) waits for the old claim to run out."""
    dead = pool("restarted")
    dead._stop.set()   # dies: no heartbeats, no leave
    for thread in dead._threads:
        thread.join()
    again = pool("restarted")
    again.put_request(_request("r"))
    assert [r.request_id for r in _take(again, 1)] == ["r"]


def test_a_request_a_peer_took_is_not_expired_by_the_queue_ttl(pool) -> None:
    """ttl_s bounds the wait in the queue: a request a peer took, still without output when the
    origin's TTL check comes, stays with the peer and is answered by it (it used to be withdrawn
    and answered by no one)."""
    a, b = pool("a", ttl_s=0.3), pool("b")
    a.put_request(_request("taken"))
    (held,) = _take(b, 1)
    time.sleep(0.8)   # several of a's heartbeats past ttl_s
    b.put_results([_output(held, 4, finished=True)])
    (final,) = [o for o in _results_until(a, lambda got: any(o.finished for o in got)) if o.finished]
    assert final.request_id == "taken" and final.finish_reason == FinishReason.LENGTH and final.error is None
    assert b.take_cancelled() == []


def test_a_request_still_queued_after_the_ttl_is_answered_with_an_error(pool) -> None:
    a = pool("a", ttl_s=0.3, steal_min_queued=100)
    a.put_request(_request("waiting"))
    (final,) = _results_until(a, lambda got: any(o.finished for o in got), timeout=3)
    assert final.finish_reason == FinishReason.ERROR and "expired after waiting 0.3 s" in final.error


def test_a_redis_with_a_password_serves_a_pool_and_errors_never_show_it(make_redis_server) -> None:
    server = make_redis_server(password="pool-s3cret")
    a = GlobalScheduler(GlobalSchedulerSettings(url=server.url, instance_id="a", **FAST), hooks=_no_hooks(),
                        max_queue_size=4)
    try:
        a.put_request(_request("r"))
        assert [r.request_id for r in _take(a, 1)] == ["r"]
    finally:
        a.close()
    wrong = server.url.replace("pool-s3cret", "not-it")
    with pytest.raises(ConfigError) as info:
        GlobalScheduler(GlobalSchedulerSettings(url=wrong, **FAST), hooks=_no_hooks(), max_queue_size=4)
    assert info.value.key == "scheduler.options.url" and "redis://***@127.0.0.1" in str(info.value)
    assert "not-it" not in str(info.value)


def test_a_redis_cluster_node_is_refused_at_start_up(make_redis_server) -> None:
    """The scripts take key names from ARGV, which a cluster cannot route: refused, not half-working."""
    from tests.fd_core.server.conftest import free_port

    server = make_redis_server(extra_args=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                           "--cluster-port", str(free_port())))   # not its port + 10000
    with pytest.raises(ConfigError, match="runs in cluster mode") as info:
        GlobalScheduler(GlobalSchedulerSettings(url=server.url, **FAST), hooks=_no_hooks(), max_queue_size=4)
    assert info.value.key == "scheduler.options.url"
