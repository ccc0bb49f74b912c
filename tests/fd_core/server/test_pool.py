"""Two fd-serve instances sharing a real redis-server (the ``global`` scheduler), on 127.0.0.1.

Requests are all sent to A, whose engine runs two at a time, so B (idle) takes work from A's
queue. Every answer is checked against the offline engine's greedy output (one instance, local
scheduler): a duplicated or missing token after a failure would change the text, and a
constrained request (:mod:`tests.fd_core.server.constrained`) continued elsewhere would break its
constraint if the new holder did not replay it over the tokens already delivered.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from fd_core.request import Request, SamplingParams
from fd_core.server import wire
from tests.fd_core.server import constrained
from tests.fd_core.server.conftest import TINY_ARGS, ServerProcess, start_server
from tests.fd_core.server.fault_schedule import POOL_KEYS
from tests.fd_core.server.test_requests import metric, metrics, wait_all_blocks_free

PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(12 + i)] for i in range(8)]
MAX_TOKENS = 48
#: Bound on how long any request of these tests may take, failures and recovery included.
REQUEST_TIMEOUT_S = 90.0


#: Output length of the requests that outlive a killed holder.
LONG_MAX_TOKENS = 160

#: The pool's lease (at least heartbeat_s + 2 x socket_timeout_s of the config below).
LEASE_S = 1.2

#: Prompts (indexes) of the constrained streams that run beside the others when a holder is killed.
CONSTRAINED = range(4)


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[Any, str]:
    """Greedy text of each prompt from one offline engine with the local scheduler: ``[i]`` for
    MAX_TOKENS, ``["long", i]`` for LONG_MAX_TOKENS, ``["json", i]`` constrained (for CONSTRAINED)."""
    from fd_core.engine.llm import LLM

    llm = LLM(str(tiny_model), cache={"num_blocks": 256})
    texts: dict[Any, str] = {}
    for key, max_tokens in ((lambda i: i, MAX_TOKENS), (lambda i: ("long", i), LONG_MAX_TOKENS)):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        texts.update((key(i), r.text) for i, r in enumerate(llm.generate(PROMPTS, params)))
    texts.update((("json", i), text) for i, text in zip(
        CONSTRAINED, constrained.references(llm, [PROMPTS[i] for i in CONSTRAINED]), strict=True))
    return texts


def _pool_config(tmp_path: Path, url: str, name: str) -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""
[scheduler]
name = "global"
[scheduler.options]
url = "{url}"
instance_id = "{name}"
heartbeat_s = 0.2
socket_timeout_s = 0.5
lease_s = {LEASE_S}
steal_min_queued = 1
""")
    return str(path)


def _start(tmp_path: Path, tiny_model: Path, url: str, name: str, *args: str) -> ServerProcess:
    return start_server(tmp_path, "--config", _pool_config(tmp_path, url, name), "--model.source", str(tiny_model),
                        *TINY_ARGS, *args, name=name)


def _stream(url: str, index: int, started: threading.Event | None = None, max_tokens: int = MAX_TOKENS, *,
            constrained_reply: bool = False) -> str:
    """The streamed text of one greedy completion of PROMPTS[index] (with ``constrained_reply``, one
    constrained by :data:`constrained.RESPONSE_FORMAT` instead); raises on an error event."""
    body = (constrained.body(PROMPTS[index]) if constrained_reply else
            {"prompt": PROMPTS[index], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    body["stream"] = True
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            if started is not None and text:
                started.set()
    return text


def _complete(url: str, index: int) -> str:
    body = {"prompt": PROMPTS[index], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    response = httpx.post(url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def _wait_for(condition: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return value


def _figure(server: ServerProcess, name: str) -> float:
    return metric(metrics(server.url), name)


def _runs_for_peers(redis_url: str, holder: str) -> list[tuple[Request, int]]:
    """What ``holder`` runs for its peers, read from the pool's keys (see
    ``fd_plugins.schedulers.pool.store``): each request, with how many of its output tokens were
    routed to its origin so far."""
    runs = []
    with redis.Redis.from_url(redis_url) as client:   # bytes: a record's request is msgpack
        for key in client.scan_iter(f"{POOL_KEYS}:r:*"):
            record = client.hgetall(key)
            if record.get(b"holder") == holder.encode():
                routed = client.llen(f"{POOL_KEYS}:t:{key.decode().removeprefix(f'{POOL_KEYS}:r:')}")
                runs.append((wire.decode_request(wire.unpack(record[b"req"])), routed))
    return runs


@pytest.fixture
def pool(redis_server: Any, tiny_model: Path, tmp_path: Path):
    """A (two requests at a time) and B, sharing ``redis_server``."""
    a = _start(tmp_path, tiny_model, redis_server.url, "a", "--engine.max_num_seqs", "2")
    try:
        b = _start(tmp_path, tiny_model, redis_server.url, "b")
    except BaseException:
        a.stop()
        raise
    yield a, b
    for server in (a, b):
        server.stop()


def test_a_busy_instance_s_requests_are_shared_and_answered_exactly_through_it(pool, reference) -> None:
    a, b = pool
    with ThreadPoolExecutor(8) as workers:   # long streams: A stays busy for B's steal polls
        streamed = list(workers.map(lambda i: _stream(a.url, i, max_tokens=LONG_MAX_TOKENS), range(8)))
        whole = list(workers.map(lambda i: _complete(a.url, i), range(8)))
    assert streamed == [reference["long", i] for i in range(8)]
    assert whole == [reference[i] for i in range(8)]
    served = _figure(b, "fd_scheduler_served_for_peers_total")
    taken = _figure(a, "fd_scheduler_taken_by_peers_total")
    assert served > 0 and taken == served, (served, taken)
    assert _figure(a, "fd_scheduler_redis_round_trips_total") > 0
    for server in (a, b):
        wait_all_blocks_free(server.url)
        assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_kill_9_of_a_holder_re_serves_its_requests_without_duplicate_or_gap(pool, redis_server, reference) -> None:
    """B is killed while it holds constrained requests mid-JSON (some of their tokens delivered):
    A serves them again from those tokens, and each reply still validates, with the undisturbed text."""
    a, b = pool
    starts = [threading.Event() for _ in range(8)]
    with ThreadPoolExecutor(8 + len(CONSTRAINED)) as workers:
        futures = [workers.submit(_stream, a.url, i, starts[i], LONG_MAX_TOKENS) for i in range(8)]
        guided = [workers.submit(_stream, a.url, i, constrained_reply=True) for i in CONSTRAINED]
        # mid-JSON: B holds a constrained request (unfinished: its final output deletes the record)
        # some of whose tokens it routed to A
        _wait_for(lambda: sum(s.is_set() for s in starts) > 2 and any(
            request.sampling_params.guided is not None and routed > 0
            for request, routed in _runs_for_peers(redis_server.url, "b")),
            "B to run some of A's requests, constrained ones among them with tokens delivered")
        os.kill(b.engine_pid(), signal.SIGKILL)
        os.kill(b.proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        texts = [future.result(timeout=REQUEST_TIMEOUT_S) for future in futures]
        replies = [future.result(timeout=REQUEST_TIMEOUT_S) for future in guided]
        recovery_s = time.monotonic() - t0
    assert texts == [reference["long", i] for i in range(8)], "a stream differs from the single-instance answer"
    for index, reply in zip(CONSTRAINED, replies, strict=True):
        constrained.check(reply, reference["json", index])
    assert _figure(a, "fd_scheduler_leases_expired_total") >= 1
    assert _figure(a, "fd_scheduler_reserved_total") >= 1
    assert recovery_s < REQUEST_TIMEOUT_S
    wait_all_blocks_free(a.url)


def test_kill_9_of_the_origin_stops_its_requests_on_the_peer(pool) -> None:
    a, b = pool
    starts = [threading.Event() for _ in range(8)]
    workers = ThreadPoolExecutor(8)
    futures = [workers.submit(_stream, a.url, i, starts[i], 400) for i in range(8)]
    _wait_for(lambda: _figure(b, "fd_scheduler_holding_for_peers") > 0 and _figure(b, "fd_kv_cache_blocks_used") > 0,
              "B to run some of A's requests")
    os.kill(a.engine_pid(), signal.SIGKILL)
    os.kill(a.proc.pid, signal.SIGKILL)
    for future in futures:
        # A's clients lose their connection with A. A blind Exception is meant (B017): the error depends on where
        # the stream was cut (a transport error from httpx, or an error event if A's server saw its engine die).
        with pytest.raises(Exception):  # noqa: B017
            future.result(timeout=REQUEST_TIMEOUT_S)
    workers.shutdown()
    _wait_for(lambda: _figure(b, "fd_scheduler_holding_for_peers") == 0, "B to give A's requests up", timeout=15)
    wait_all_blocks_free(b.url, timeout=15)


def test_redis_lost_and_back_nothing_accepted_is_lost(pool, redis_server, reference) -> None:
    a, b = pool
    starts = [threading.Event() for _ in range(8)]
    with ThreadPoolExecutor(8) as workers:
        futures = [workers.submit(_stream, a.url, i, starts[i]) for i in range(8)]
        _wait_for(lambda: sum(s.is_set() for s in starts) >= 2, "streams to start")
        redis_server.stop()
        texts = [future.result(timeout=REQUEST_TIMEOUT_S) for future in futures]
        assert texts == [reference[i] for i in range(8)]
        for server in (a, b):
            health = _wait_for(lambda s=server: (h := httpx.get(s.url + "/health").json())["status"] == "degraded"
                               and h, "/health to say degraded")
            assert "unreachable" in health["reason"]
            assert _figure(server, "fd_scheduler_degraded") == 1
        # each still answers what reaches it directly
        assert _complete(a.url, 0) == reference[0] and _complete(b.url, 1) == reference[1]
        redis_server.start()
        _wait_for(lambda: all(httpx.get(s.url + "/health").json()["status"] == "ok" for s in (a, b)),
                  "both instances to rejoin the pool")
        before = _figure(b, "fd_scheduler_served_for_peers_total")
        # long enough that A still has a queue when B next looks, however fast the kernels are
        again = list(workers.map(lambda i: _stream(a.url, i, max_tokens=LONG_MAX_TOKENS), range(8)))
    assert again == [reference["long", i] for i in range(8)]
    assert _figure(b, "fd_scheduler_served_for_peers_total") > before, "B took no work from A after the rejoin"


def test_an_origin_paused_longer_than_a_lease_ends_every_stream_exactly(pool, reference) -> None:
    """Issue 41 item 2: A is paused (SIGSTOP) longer than a lease while B runs some of its streams.
    B's reaper drops A's queue and output list and B gives up what it ran for A, as for a dead
    origin; resumed, A notices at its next heartbeat and serves those requests itself, from the
    tokens its clients have: every stream ends, with the text of one uninterrupted run."""
    a, b = pool
    streams = 3 * len(PROMPTS)   # A runs 2 at a time: the rest wait in A's queue or run on B
    starts = [threading.Event() for _ in range(streams)]
    with ThreadPoolExecutor(streams) as workers:
        futures = [workers.submit(_stream, a.url, i % len(PROMPTS), starts[i], LONG_MAX_TOKENS)
                   for i in range(streams)]
        _wait_for(lambda: _figure(b, "fd_scheduler_holding_for_peers") > 0 and sum(s.is_set() for s in starts) > 2,
                  "B to hold some of A's requests while their streams run")
        paused = [a.proc.pid, a.engine_pid()]
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(2.5 * LEASE_S)
            assert _figure(b, "fd_scheduler_holding_for_peers") == 0, "B still runs A's requests"
        finally:
            for pid in paused:
                os.kill(pid, signal.SIGCONT)
        texts = [future.result(timeout=REQUEST_TIMEOUT_S) for future in futures]
    assert texts == [reference["long", i % len(PROMPTS)] for i in range(streams)], \
        "a stream differs from the single-instance answer"
    assert _figure(a, "fd_scheduler_lapses_total") >= 1
    for server in (a, b):
        wait_all_blocks_free(server.url)
        assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_a_data_parallel_rank_s_request_continues_in_the_pool_after_its_tokens(redis_server, tiny_model, tmp_path,
                                                                             reference) -> None:
    """Issue 41 item 9: with data_parallel_size 2 each rank is a pool member; a rank killed
    mid-stream has its requests continued on the other rank, which puts them into the pool with
    the tokens the client has: the stream goes on after them (it used to start again from the
    first token: duplicates, and more than max_tokens)."""
    path = tmp_path / "dp.toml"
    config = Path(_pool_config(tmp_path, redis_server.url, "dp")).read_text()
    path.write_text(config.replace('instance_id = "dp"\n', ""))   # each rank is a member of its own id
    server = start_server(tmp_path, "--config", str(path), "--model.source", str(tiny_model), *TINY_ARGS,
                          "--parallel.data_parallel_size", "2", name="dp")
    try:
        starts = [threading.Event() for _ in range(2)]
        with ThreadPoolExecutor(2) as workers:   # one stream a rank (placement by tokens in flight)
            futures = [workers.submit(_stream, server.url, i, starts[i], LONG_MAX_TOKENS) for i in range(2)]
            assert all(start.wait(60) for start in starts)
            os.kill(server.engine_pids()[1], signal.SIGKILL)
            texts = [future.result(timeout=REQUEST_TIMEOUT_S) for future in futures]
        assert texts == [reference["long", i] for i in range(2)], "a continued stream differs from one run"
        assert metric(metrics(server.url), "fd_dp_requests_continued_total") >= 1
    finally:
        assert server.stop() == 0, server.log()


def test_a_draining_instance_takes_no_work_from_its_peers(pool, reference) -> None:
    """Issue 41 item 16: after SIGTERM, B finishes what is in flight (a request whose body is still
    coming) but takes none of A's queued requests: the front end tells the engine to drain."""
    a, b = pool
    release = threading.Event()

    def slow_body() -> Any:   # keeps a request of B's in flight, so B drains until released
        data = json.dumps({"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}).encode()
        yield data[:10]
        release.wait(REQUEST_TIMEOUT_S)
        yield data[10:]

    with ThreadPoolExecutor(9) as workers:
        held_open = workers.submit(httpx.post, b.url + "/v1/completions", content=slow_body(),
                                   headers={"content-type": "application/json"}, timeout=REQUEST_TIMEOUT_S)
        time.sleep(0.5)
        taken_before = _figure(a, "fd_scheduler_taken_by_peers_total")
        b.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)   # (the front end starts its drain at its next tick)
        try:
            whole = list(workers.map(lambda i: _complete(a.url, i), range(8)))
            assert b.proc.poll() is None, "B stopped before A's requests were done: nothing was shown"
        finally:
            release.set()
        held_open.result(timeout=REQUEST_TIMEOUT_S)
    assert whole == [reference[i] for i in range(8)]
    assert _figure(a, "fd_scheduler_taken_by_peers_total") == taken_before, "B took A's work while draining"
    assert b.proc.wait(timeout=60) == 0
