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

FAST = {"heartbeat_s": 0.1, "socket_timeout_s": 0.25, "lease_s": 0.6, "poll_s": 0.02, "steal_min_queued": 1}


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


def _cancelled(scheduler: GlobalScheduler, timeout: float = 3.0) -> list[str]:
    """take_cancelled the way the engine loop calls it (each step), until it names something."""
    deadline = time.monotonic() + timeout
    while not (cancelled := scheduler.take_cancelled()):
        assert time.monotonic() < deadline, "nothing was cancelled"
        time.sleep(0.02)
    return cancelled


def _die(member: GlobalScheduler) -> None:
    """The member's threads stop without leaving the pool (kill -9 as far as Redis can tell)."""
    member._stop.set()
    member.wake()
    with member._lock:
        member._io.notify_all()
    for thread in member._threads:
        thread.join()


def _silence(member: GlobalScheduler) -> None:
    """The member stops heartbeating (as if it hung): its liveness and leases run out, while its
    other threads go on (what it pushes late is fenced)."""
    member._beat = lambda: None


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
    _silence(b)     # B "hangs": no heartbeats, so its lease runs out
    (again,) = _take(a, 1)      # re-queued at the front of A's queue after lease_s
    assert again.request_id == "r" and again.output_token_ids == [11, 12]
    b.put_results([_output(held, 99)])           # B wakes up late: fenced, nothing reaches A
    a.put_results([_output(again, 13, finished=True)])
    rest = _results_until(a, lambda got: any(o.finished for o in got))
    assert [t for o in first + rest for t in o.new_token_ids] == [11, 12, 13]
    assert _cancelled(b) == ["r"]
    assert a.stats()["leases_expired"] + b.stats()["leases_expired"] >= 1


def test_an_origin_that_dies_has_its_requests_given_up_by_the_holder(pool) -> None:
    a, b = pool("a"), pool("b")
    a.put_request(_request("r"))
    (held,) = _take(b, 1)
    _die(a)
    assert _cancelled(b) == ["r"]
    b.put_results([RequestOutput("r", finished=True, finish_reason=FinishReason.ABORT)])   # the engine ends it
    assert b.stats()["holding_for_peers"] == 0


def test_abort_of_a_request_a_peer_holds_answers_at_once_and_the_peer_drops_it(pool) -> None:
    a, b = pool("a"), pool("b")
    a.put_request(_request("r"))
    (held,) = _take(b, 1)
    assert a.abort("r") is True
    (answer,) = _results_until(a, lambda got: bool(got))
    assert answer.finished and answer.finish_reason is FinishReason.ABORT
    b.put_results([_output(held, 1)])
    assert _cancelled(b) == ["r"]
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
    assert _cancelled(b) == ["held-by-b"]
    a.put_request(_request("during"))                 # accepted while degraded
    assert [r.request_id for r in a.get_requests(8, timeout=1)] == ["during"]
    redis_server.start()
    deadline = time.monotonic() + 5
    while not (a.stats()["redis_up"] and b.stats()["redis_up"]):
        assert time.monotonic() < deadline, (a.stats(), b.stats())
        time.sleep(0.05)
    assert a.get_requests(0, timeout=0) == []   # A's engine is full: B takes what A queues next
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
    _die(dead)
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


def test_a_pool_over_tls_with_a_password_takes_steals_and_answers(make_redis_server, tmp_path) -> None:
    """``rediss://``: both members' connections (commands and the blocking result reader) over TLS."""
    import shutil
    import subprocess

    from tests.fd_core.server.conftest import free_port

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (apt-get install openssl; .ci/run installs it)")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    tls_port = free_port()
    make_redis_server(password="tls-s3cret", extra_args=(   # its plain port stays, for the readiness check
        "--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
        "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"))
    url = f"rediss://:tls-s3cret@127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}"
    a, b = (GlobalScheduler(GlobalSchedulerSettings(url=url, instance_id=name, **FAST), hooks=_no_hooks(),
                            max_queue_size=8) for name in ("a", "b"))
    try:
        for i in range(3):
            a.put_request(_request(f"r{i}"))
        mine = a.get_requests(1, timeout=1)
        stolen = _take(b, 2)
        assert sorted(r.request_id for r in mine + stolen) == ["r0", "r1", "r2"] and len(stolen) == 2
        for request in mine + stolen:
            (a if request in mine else b).put_results([_output(request, 9, finished=True)])
        got = _results_until(a, lambda got: sum(o.finished for o in got) == 3)
        assert sorted(o.request_id for o in got if o.finished) == ["r0", "r1", "r2"]
    finally:
        a.close()
        b.close()
    untrusted = f"rediss://:tls-s3cret@127.0.0.1:{tls_port}/0"   # the self-signed certificate is not trusted
    with pytest.raises(ConfigError) as info:
        GlobalScheduler(GlobalSchedulerSettings(url=untrusted, **FAST), hooks=_no_hooks(), max_queue_size=4)
    assert info.value.key == "scheduler.options.url" and "tls-s3cret" not in str(info.value)
    assert "certificate" in str(info.value).lower()


def test_a_redis_cluster_node_is_refused_at_start_up(make_redis_server) -> None:
    """The scripts take key names from ARGV, which a cluster cannot route: refused, not half-working."""
    from tests.fd_core.server.conftest import free_port

    server = make_redis_server(extra_args=("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                                           "--cluster-port", str(free_port())))   # not its port + 10000
    with pytest.raises(ConfigError, match="runs in cluster mode") as info:
        GlobalScheduler(GlobalSchedulerSettings(url=server.url, **FAST), hooks=_no_hooks(), max_queue_size=4)
    assert info.value.key == "scheduler.options.url"


# --- issue 41: a live origin reaped by its peers, continuations, lease ids, leftover keys, the engine step ---


def _redis(member: GlobalScheduler) -> Any:
    import redis

    return redis.Redis.from_url(member._store.url)


def _keys(member: GlobalScheduler) -> set[str]:
    """The pool's keys in Redis, without the ``fd:{topic}:`` prefix."""
    prefix = member._store.prefix + ":"
    return {key.decode().removeprefix(prefix) for key in _redis(member).keys("*")}


def _tokens(outputs: list[RequestOutput]) -> dict[str, list[int]]:
    by_id: dict[str, list[int]] = {}
    for output in outputs:
        by_id.setdefault(output.request_id, []).extend(output.new_token_ids)
    return by_id


def _until(condition: Callable[[], Any], what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _held_by_b(pool: Callable[..., GlobalScheduler],
               token: int) -> tuple[GlobalScheduler, GlobalScheduler, Request, list[RequestOutput]]:
    """A (its engine full) and B; B holds A's request ``r`` and routed ``token``, which A's client has."""
    a, b = pool("a"), pool("b")
    assert a.get_requests(0, timeout=0) == []
    a.put_request(_request("r"))
    (held,) = _take(b, 1)
    b.put_results([_output(held, token)])
    return a, b, held, _results_until(a, lambda got: bool(got))


def test_a_lease_that_cannot_outlast_the_heartbeat_s_round_trips_is_refused_naming_the_key() -> None:
    """Between two renewals lie heartbeat_s and up to two Redis calls of socket_timeout_s each
    (the rest of one heartbeat script's call, the start of the next): a shorter lease lets the
    peers of a member that is merely slow reap it."""
    from fd_core.config import load_config
    from fd_core.selection import resolve

    config = load_config(scheduler={"name": "global", "options": {"heartbeat_s": 0.5, "lease_s": 3.0,
                                                                  "socket_timeout_s": 2.0}})
    with pytest.raises(ConfigError) as info:
        resolve(config)
    assert info.value.key == "scheduler.options.lease_s"
    assert "heartbeat_s (0.5) + 2 x socket_timeout_s (2) = 4.5 s" in str(info.value)
    GlobalSchedulerSettings(heartbeat_s=0.5, socket_timeout_s=1.0, lease_s=2.5)   # exactly enough
    assert GlobalSchedulerSettings().lease_s >= 0.5 + 2 * 1.0                      # the defaults hold


def test_an_origin_whose_liveness_lapsed_serves_what_its_peers_dropped_from_the_tokens_its_clients_have(pool) -> None:
    """Issue 41 item 2: an origin paused longer than lease_s is reaped by its peers (its queue and
    records dropped, what they held for it given up) though it lives. Its next heartbeat notices,
    and it serves every request it originated itself, continuing from the tokens its clients have."""
    a, b = pool("a"), pool("b")
    assert a.get_requests(0, timeout=0) == []   # A's engine is full: its requests wait in Redis
    for i in range(4):
        a.put_request(_request(f"r{i}"))
    held = _take(b, 2)
    assert [r.request_id for r in held] == ["r0", "r1"]
    b.put_results([_output(held[0], 5)])
    first = _results_until(a, lambda got: bool(got))
    a._beat = lambda: None   # A pauses (its heartbeat does), for longer than a lease
    assert sorted(_cancelled(b)) == ["r0", "r1"]   # B finds A gone and gives up what it ran for A
    for request in held:                            # (B's engine ends them)
        b.put_results([RequestOutput(request.request_id, finished=True, finish_reason=FinishReason.ABORT)])
    _until(lambda: "q:a" not in _keys(a), "B's reaper to drop A's queue")
    del a._beat              # A resumes
    served = _take(a, 4)
    assert {r.request_id: r.output_token_ids for r in served} == {"r0": [5], "r1": [], "r2": [], "r3": []}
    assert a.stats()["lapses"] == 1 and a.stats()["redis_up"] == 1 and a.stats()["degraded_reason"] is None
    for request in served:
        a.put_results([_output(request, 9, finished=True)])
    rest = _results_until(a, lambda got: sum(o.finished for o in got) == 4)
    assert _tokens(first + rest) == {"r0": [5, 9], "r1": [9], "r2": [9], "r3": [9]}
    assert _keys(a) == {"alive:a", "alive:b", "inst", "load"}   # A's records were withdrawn


def test_a_continuation_put_into_the_pool_goes_on_after_its_tokens_wherever_it_runs(pool) -> None:
    """Issue 41 item 9: a data-parallel rank's request continued on another rank enters the pool
    with the tokens its client has; whoever runs it (its origin or a thief) goes on after them,
    and what an earlier request of the same id left in Redis (progress, a lease) counts for nothing."""
    a, b = pool("a"), pool("b")
    client = _redis(a)
    prefix = a._store.prefix
    for request_id in ("kept", "stolen"):   # left by an earlier holder of these ids (the dead rank's)
        client.rpush(f"{prefix}:t:{request_id}", 90, 91, 92)
        client.zadd(f"{prefix}:leases", {request_id: 0})
    assert a.get_requests(0, timeout=0) == []
    for request_id, tokens in (("kept", [5, 6]), ("stolen", [7])):
        a.put_request(Request(request_id, [1, 2, 3], SamplingParams(max_tokens=4), output_token_ids=tokens))
    (kept,) = _take(a, 1)
    (stolen,) = _take(b, 1)
    assert (kept.request_id, kept.output_token_ids) == ("kept", [5, 6])
    assert (stolen.request_id, stolen.output_token_ids) == ("stolen", [7])
    b.put_results([_output(stolen, 8)])
    b.put_results([_output(stolen, 9, finished=True)])
    a.put_results([_output(kept, 8)])
    a.put_results([_output(kept, 9, finished=True)])
    got = _results_until(a, lambda got: sum(o.finished for o in got) == 2)
    assert _tokens(got) == {"kept": [8, 9], "stolen": [8, 9]}   # the client had the rest already
    time.sleep(2 * FAST["lease_s"])
    assert a.stats()["leases_expired"] + b.stats()["leases_expired"] == 0   # the stale lease re-queued nothing
    assert a.get_requests(4, timeout=0.3) == [] and b.get_requests(4, timeout=0.3) == []


def test_a_holder_that_takes_a_request_again_sends_nothing_of_its_old_run(pool) -> None:
    """Issue 41 item 10: B is slow, its lease runs out, and B takes the same request again. The
    old run's outputs (and its abort) are fenced on the old lease id, and the engine gets the new
    run only once it has ended the old one, so the origin's client sees each token once."""
    a, b, old, first = _held_by_b(pool, 1)
    b._beat = lambda: None   # B is slow: its lease runs out and A's reaper queues r again at A
    _until(lambda: a.stats()["leases_expired"] == 1, "the lease to run out")
    handed: list[Request] = []

    def taken_again() -> bool:   # B's engine has room (a step a call): B takes r again, under a new lease
        handed.extend(b.get_requests(1, timeout=0))
        return _redis(a).llen(f"{a._store.prefix}:q:a") == 0
    _until(taken_again, "B to take r again")
    del b._beat
    handed += b.get_requests(1, timeout=0.3)
    assert handed == [], "the engine got the new run while it still ran the old one"
    assert b.stats()["deferred"] == 1
    b.put_results([_output(old, 2)])              # the old run's next token: fenced
    assert _cancelled(b) == ["r"]
    b.put_results([RequestOutput("r", finished=True, finish_reason=FinishReason.ABORT, num_prompt_tokens=3,
                                 num_output_tokens=2)])   # the engine ends the old run: its abort goes nowhere
    (new,) = _take(b, 1)
    assert new.output_token_ids == [1]
    b.put_results([_output(new, 2)])
    b.put_results([_output(new, 3, finished=True)])
    rest = _results_until(a, lambda got: any(o.finished for o in got))
    assert _tokens(first + rest) == {"r": [1, 2, 3]}
    assert [o.finish_reason for o in rest if o.finished] == [FinishReason.LENGTH]
    assert b.take_cancelled() == [] and b.stats()["holding_for_peers"] == 0


def test_after_a_redis_outage_rejoin_and_drain_no_key_is_left_but_the_members_own(pool, redis_server) -> None:
    """Issue 41 item 11: Redis stalls (its data kept) longer than socket_timeout_s; both members
    turn degraded, the origin answers its requests itself, both rejoin. Nothing of those requests
    (records with their prompts, progress, queues) is left in Redis, and leaving takes the rest."""
    a, b = pool("a"), pool("b")
    assert a.get_requests(0, timeout=0) == []
    for i in range(4):
        a.put_request(_request(f"r{i}"))
    held = _take(b, 2)
    b.put_results([_output(held[0], 5)])
    first = _results_until(a, lambda got: bool(got))
    _redis(a).client_pause(int(8 * FAST["socket_timeout_s"] * 1000))   # every client waits: a stall
    _until(lambda: not (a.stats()["redis_up"] or b.stats()["redis_up"]), "both to lose Redis")
    local = _take(a, 4)
    assert {r.request_id: r.output_token_ids for r in local} == {"r0": [5], "r1": [], "r2": [], "r3": []}
    for request in local:
        a.put_results([_output(request, 9, finished=True)])
    done = _results_until(a, lambda got: sum(o.finished for o in got) == 4)
    assert _tokens(first + done) == {"r0": [5, 9], "r1": [9], "r2": [9], "r3": [9]}
    assert sorted(_cancelled(b)) == ["r0", "r1"]
    for request in held:   # the engine ends B's runs
        b.put_results([RequestOutput(request.request_id, finished=True, finish_reason=FinishReason.ABORT)])
    _until(lambda: a.stats()["redis_up"] and b.stats()["redis_up"], "both to rejoin", timeout=10)
    time.sleep(3 * FAST["heartbeat_s"])
    assert _keys(a) == {"alive:a", "alive:b", "inst", "load"}
    a.close()
    b.close()
    assert _keys(a) == set()


def test_no_redis_call_is_made_on_the_engine_s_thread(pool) -> None:
    """Issue 41 item 16: get_requests, put_results, abort and take_cancelled only touch memory; a
    thread of the scheduler's own talks to Redis (batching several steps' outputs in one script
    when Redis is slower than a step)."""
    import threading

    a, b = pool("a"), pool("b")
    callers: list[str] = []
    for member in (a, b):
        call = member._store._call

        def recording(fn: Any, *args: Any, _call: Any = call, **kwargs: Any) -> Any:
            callers.append(threading.current_thread().name)
            return _call(fn, *args, **kwargs)

        member._store._call = recording
    assert a.get_requests(0, timeout=0) == []
    engine = threading.current_thread().name
    for i in range(4):
        a.put_request(_request(f"r{i}"))       # (the engine's input thread: not a step)
    callers.clear()
    held = _take(b, 4)
    for step in range(30):
        b.put_results([_output(request, step, finished=step == 29) for request in held])
        assert b.get_requests(4, timeout=0) == [] and b.take_cancelled() == []
    got = _results_until(a, lambda got: sum(o.finished for o in got) == 4)
    assert _tokens(got) == {f"r{i}": list(range(30)) for i in range(4)}
    assert engine not in callers and callers, callers


def test_a_member_with_a_full_kv_cache_or_draining_takes_nothing_from_a_peer(pool) -> None:
    """Issue 41 item 16: stolen work would wait behind a full KV cache (and its lease be renewed
    while it waits) where an idle peer could run it; a draining member is leaving."""
    from fd_core.contracts.resource_manager import KVStats

    a, b = pool("a"), pool("b")
    assert a.get_requests(0, timeout=0) == []
    for i in range(3):
        a.put_request(_request(f"r{i}"))
    b.note_capacity(KVStats(num_blocks=64, num_free_blocks=0, num_running=3, num_waiting=0), 5)
    assert b.get_requests(4, timeout=0.5) == []
    b.note_capacity(KVStats(num_blocks=64, num_free_blocks=20, num_running=3, num_waiting=1), 5)
    assert b.get_requests(4, timeout=0.5) == []
    b.note_capacity(KVStats(num_blocks=64, num_free_blocks=20, num_running=3, num_waiting=0), 0)
    assert b.get_requests(4, timeout=0.5) == []   # no free slot: asked for more (fair sharing) takes no peer's
    b.note_capacity(KVStats(num_blocks=64, num_free_blocks=20, num_running=3, num_waiting=0), 5)
    assert [r.request_id for r in _take(b, 1)] == ["r0"]
    b.drain()
    assert b.get_requests(4, timeout=0.5) == []
    assert _redis(a).llen(f"{a._store.prefix}:q:a") == 2   # still A's, for A or another peer
    b.put_request(_request("own"))                          # a draining member serves its own
    assert [r.request_id for r in _take(b, 1)] == ["own"]


def test_an_engine_whose_requests_wait_for_kv_blocks_takes_nothing_from_a_peer(pool, redis_server, tmp_path) -> None:
    """Issue 41 item 16, through a real engine loop: the core tells the scheduler the resource
    manager's figures after every step; while a request of B's waits for blocks, A's queued
    requests stay in Redis (for A, or a peer with room); once B has room again it takes them.
    A draining engine takes none."""
    from fd_core.config import load_config
    from fd_core.engine.builder import build_engine
    from fd_core.testing.tiny_model import make_tiny_llama

    model = make_tiny_llama(tmp_path / "model", layers=1, vocab=512, max_position_embeddings=512)
    options = {**FAST, "url": redis_server.url, "instance_id": "b"}
    engine = build_engine(load_config(model={"source": str(model), "max_model_len": 512},
                                      cache={"num_blocks": 4, "block_size": 64},
                                      scheduler={"name": "global", "options": options}))
    try:
        a = pool("a")
        assert a.get_requests(0, timeout=0) == []
        queue_of_a = f"{a._store.prefix}:q:a"
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for i in range(2):   # each needs 3 of the 4 blocks: the second waits for the first
            engine.add_request(Request(f"b{i}", [(7 * i + j) % 500 + 3 for j in range(130)], params))
        _until(lambda: engine.step() is not None and engine.resource_manager.stats().num_waiting == 1,
               "B's second request to wait for blocks")
        for i in range(2):
            a.put_request(Request(f"a{i}", [5, 6, 7], params))
        steps_waiting = 0
        while engine.step() is not None and engine.resource_manager.stats().num_waiting:
            time.sleep(0.02)   # (time for B's I/O thread to take, were it to)
            assert _redis(a).llen(queue_of_a) == 2, "B took A's requests while its own waited for blocks"
            steps_waiting += 1
        assert steps_waiting > 0
        _until(lambda: engine.step() is not None and _redis(a).llen(queue_of_a) == 0, "B to take A's requests")
        got: list[RequestOutput] = []
        _until(lambda: engine.step() is not None and (got.extend(a.get_results(timeout=0)) or True)
               and sum(o.finished for o in got) == 2, "A's requests to be answered through B")
        engine.drain()
        a.put_request(Request("a-late", [5, 6, 7], params))
        for _ in range(20):
            engine.step()
            time.sleep(0.02)
        assert _redis(a).llen(queue_of_a) == 1, "a draining engine took a peer's request"
    finally:
        engine.close()


def test_a_member_leaving_gives_what_it_held_back_at_once_and_takes_its_keys(pool) -> None:
    """At shutdown a member's held requests go back to the front of their origin's queue without
    waiting lease_s (continuing from the tokens routed), and its keys leave Redis."""
    a, b, _, first = _held_by_b(pool, 4)
    left_at = time.monotonic()
    b.close()
    (again,) = _take(a, 1, timeout=FAST["lease_s"] / 2)
    assert time.monotonic() - left_at < FAST["lease_s"] and again.output_token_ids == [4]
    assert a.stats()["leases_expired"] == 0
    a.put_results([_output(again, 5, finished=True)])
    rest = _results_until(a, lambda got: any(o.finished for o in got))
    assert _tokens(first + rest) == {"r": [4, 5]}
    assert _keys(a) == {"alive:a", "inst", "load"}
