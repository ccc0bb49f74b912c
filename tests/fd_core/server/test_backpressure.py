"""429 from fd-serve: the engine queue is full, or server.max_concurrency requests are in flight."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fd_core.server.conftest import start_server
from tests.fd_core.server.test_requests import metric, metrics


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    # one request runs at a time, one more may wait in the scheduler, two may be in flight
    server = start_server(tmp_path_factory.mktemp("bp"), "--model.source", str(tiny_model),
                          "--model.max_model_len", "512", "--cache.num_blocks", "128",
                          "--engine.max_num_seqs", "1", "--engine.max_num_batched_tokens", "64",
                          "--server.max_queue_size", "1", "--server.max_concurrency", "2")
    yield server
    assert server.stop() == 0, server.log()


def eventually_serves(url: str) -> None:
    """A small request succeeds once the rejected or finished ones are gone (aborts are asynchronous)."""
    deadline = time.monotonic() + 10
    while (status := httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                timeout=60).status_code) == 429 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert status == 200


def wait_until_nothing_waits(url: str) -> None:
    deadline = time.monotonic() + 30
    while metric(metrics(url), "fd_num_requests_waiting") > 0:
        assert time.monotonic() < deadline, metrics(url)
        time.sleep(0.02)


def stream(url: str, accepted: threading.Event, running: threading.Event, max_tokens: int = 300) -> int:
    """Stream a long completion; ``accepted`` when the engine queued it, ``running`` at its first token."""
    body = {"prompt": list(range(100, 110)), "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    count = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        accepted.set()  # headers arrive once the engine acknowledged the request
        for line in response.iter_lines():
            if line.startswith("data: {"):
                count += 1
                running.set()
    return count


def test_concurrency_limit_is_429_until_a_slot_frees(server):
    events = [(threading.Event(), threading.Event()) for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(stream, server.url, *events[0])
        assert events[0][1].wait(30)  # running: the scheduler queue is empty again
        second = pool.submit(stream, server.url, *events[1])
        assert events[1][0].wait(30)  # queued behind the first
        response = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert response.status_code == 429, response.text
        assert ("too many requests: 2 in flight, the most server.max_concurrency (2) allows"
                in response.json()["error"]["message"])
        assert response.headers["Retry-After"] == "1"
        assert [first.result(timeout=60), second.result(timeout=60)] == [300, 300]
    eventually_serves(server.url)


def test_a_request_that_fits_is_accepted_right_after_an_all_or_nothing_refusal(server):
    # The running stream leaves the one queue place free; a request of two choices queues one and
    # is refused for the other. That one must be withdrawn before the 429 goes out: the next
    # request, which fits, is accepted at once (it got a 429 when the engine loop withdrew it later).
    accepted, running = threading.Event(), threading.Event()
    with ThreadPoolExecutor(1) as pool, httpx.Client(timeout=60) as client:
        long = pool.submit(stream, server.url, accepted, running, 480)
        assert running.wait(30)
        for _ in range(5):
            refused = client.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2})
            assert refused.status_code == 429, refused.text
            assert ("request queue is full: 1 waiting, the most server.max_queue_size (1) allows"
                    in refused.json()["error"]["message"])
            fits = {"prompt": "hi", "max_tokens": 2, "stream": True}
            with client.stream("POST", server.url + "/v1/completions", json=fits) as response:
                assert response.status_code == 200, response.read()
            wait_until_nothing_waits(server.url)  # closing it aborted it
        assert not long.done()  # the refusals happened while the queue's one place was the only room
        assert long.result(timeout=60) == 480
    eventually_serves(server.url)

