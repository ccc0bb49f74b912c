"""fd-serve's process life: SIGTERM drains in-flight requests and exits 0; a dead engine fails fast."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.fd_core.server.conftest import TINY_ARGS, ServerProcess, start_server


def read_stream(url: str, body: dict, started: threading.Event) -> list[str]:
    """Every SSE data payload of one streaming completion; sets ``started`` at the first chunk."""
    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                started.set()
    return events


def test_sigterm_lets_in_flight_requests_finish_and_exits_0(tiny_model, tmp_path):
    server = start_server(tmp_path, "--model.source", str(tiny_model), *TINY_ARGS)
    body = {"prompt": list(range(100, 120)), "max_tokens": 120, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    starts = [threading.Event() for _ in range(8)]
    try:
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(read_stream, server.url, body, started) for started in starts]
            assert all(started.wait(30) for started in starts)
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            with pytest.raises(httpx.TransportError):  # the listener is closed: nothing new gets in
                httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=5)
            streams = [f.result(timeout=60) for f in futures]
        assert server.proc.wait(timeout=60) == 0, server.log()
    finally:
        server.stop()
    for events in streams:
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 120
        assert not any("error" in json.loads(e) for e in events[:-1])


def test_engine_death_turns_health_503_and_fails_in_flight_requests(tiny_model, tmp_path):
    server = start_server(tmp_path, "--model.source", str(tiny_model), *TINY_ARGS)
    try:
        started = threading.Event()
        body = {"prompt": list(range(100, 120)), "max_tokens": 480, "ignore_eos": True}
        with ThreadPoolExecutor(2) as pool:
            stream = pool.submit(read_stream, server.url, body, started)
            plain = pool.submit(httpx.post, server.url + "/v1/completions", json=body, timeout=60)
            assert started.wait(30)
            time.sleep(0.2)
            os.kill(server.engine_pid(), signal.SIGKILL)
            events = stream.result(timeout=30)
            response = plain.result(timeout=30)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "engine process exited" in error["message"]
        assert response.status_code == 503 and "engine process exited" in response.json()["error"]["message"]
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "dead"
        again = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert again.status_code == 503
    finally:
        assert server.stop() == 0


def test_a_model_that_cannot_load_stops_start_up_with_the_reason(tmp_path):
    server = ServerProcess(["--model.source", str(tmp_path / "no-such-model")], tmp_path / "server.log")
    assert server.proc.wait(timeout=120) == 1
    server.stop()
    log = server.log()
    assert "fd-serve: error:" in log and "no-such-model" in log and "not found" in log
