"""fd-serve's process life: SIGTERM drains in-flight requests and exits 0; warm-up comes before
ready; a dead engine fails fast, is named by signal, and fd-serve exits 3 for its supervisor."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.fd_core.server.conftest import TINY_ARGS, ServerProcess, start_server
from tests.fd_core.server.test_requests import metric, metrics


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


def test_requests_in_flight_when_the_shutdown_timeout_runs_out_get_the_documented_503(tiny_model, tmp_path):
    # one request runs at a time: the second waits behind the first; neither is done at SIGTERM,
    # and with shutdown_timeout_s 0 the drain gives up on both at once
    server = start_server(tmp_path, "--model.source", str(tiny_model), *TINY_ARGS, "--engine.max_num_seqs", "1",
                          "--server.shutdown_timeout_s", "0")
    body = {"prompt": list(range(100, 120)), "max_tokens": 480, "ignore_eos": True}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    try:
        started = threading.Event()
        with ThreadPoolExecutor(2) as pool:
            stream = pool.submit(read_stream, server.url, body, started)
            assert started.wait(30)
            plain = pool.submit(client.completions.create, model=str(tiny_model), prompt=body["prompt"],
                                max_tokens=480, extra_body={"ignore_eos": True})
            while metric(metrics(server.url), "fd_http_requests_in_flight") < 2:
                assert not plain.done(), plain.result()
                time.sleep(0.02)
            server.proc.send_signal(signal.SIGTERM)
            events = stream.result(timeout=60)
            with pytest.raises(openai.InternalServerError) as info:
                plain.result(timeout=60)
        assert server.proc.wait(timeout=60) == 0, server.log()
    finally:
        server.stop()
    assert info.value.status_code == 503 and info.value.code == "server_shutting_down"
    assert "server.shutdown_timeout_s (0 s) ran out" in info.value.message
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "server_shutting_down" and "server.shutdown_timeout_s" in error["message"]
    assert len(events) > 2  # tokens came before the error
    assert "timeout graceful shutdown exceeded" not in server.log()  # nothing was left for uvicorn to cut


def wait_until_not_listening(port: int) -> None:
    """Return once a new connection to ``port`` is refused (the drain closed the listener)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except ConnectionRefusedError:
            return
        assert time.monotonic() < deadline, "still listening 30 s after SIGTERM"
        time.sleep(0.02)


def test_a_request_on_a_kept_alive_connection_during_the_drain_gets_the_documented_503(tiny_model, tmp_path):
    server = start_server(tmp_path, "--model.source", str(tiny_model), *TINY_ARGS)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    body = {"prompt": list(range(100, 120)), "max_tokens": 480, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    try:
        assert client.models.list().data  # opens the connection the request below reuses
        started = threading.Event()
        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(read_stream, server.url, body, started)
            assert started.wait(30)
            server.proc.send_signal(signal.SIGTERM)
            wait_until_not_listening(server.port)
            with pytest.raises(openai.InternalServerError) as info:
                client.completions.create(model=str(tiny_model), prompt="hi", max_tokens=2)
            events = stream.result(timeout=60)
        assert server.proc.wait(timeout=60) == 0, server.log()
    finally:
        server.stop()
    assert info.value.status_code == 503 and info.value.code == "server_shutting_down"
    assert info.value.response.headers["connection"] == "close"
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 480
    assert not any("error" in json.loads(e) for e in events[:-1])


def test_engine_killed_by_sigkill_is_named_everywhere_then_fd_serve_exits_3(tiny_model, tmp_path):
    server = start_server(tmp_path, "--model.source", str(tiny_model), *TINY_ARGS,
                          "--server.exit_after_engine_death_s", "4")
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
        cause = "the engine process died: SIGKILL: killed"
        assert events[-1] == "[DONE]"
        assert cause in json.loads(events[-2])["error"]["message"]
        assert response.status_code == 503 and cause in response.json()["error"]["message"]
        health = httpx.get(server.url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "dead"
        assert cause in health.json()["reason"]
        again = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert again.status_code == 503 and cause in again.json()["error"]["message"]
        # one code for a dead engine: in flight (stream and not) and for requests after the death
        codes = {json.loads(events[-2])["error"]["code"], response.json()["error"]["code"],
                 again.json()["error"]["code"]}
        assert codes == {"engine_dead"}
        # the documented recovery: exit non-zero so that a supervisor restarts the server
        assert server.proc.wait(timeout=60) == 3, server.log()
    finally:
        server.stop()
    log = server.log()
    assert "exit code None" not in log
    assert f"fd-serve: error: {cause}" in log and "exiting so that a supervisor restarts fd-serve" in log


def test_health_says_ok_only_after_the_warm_up_ran(tiny_model, tmp_path):
    server = start_server(tmp_path, "--model.source", str(tiny_model), *TINY_ARGS)
    try:
        health = httpx.get(server.url + "/health", timeout=10).json()
        log = server.log()
    finally:
        assert server.stop() == 0
    assert health["status"] == "ok"
    assert health["engine"]["warm_up_s"] > 0
    assert health["engine"]["kernels"].startswith("rms_norm=")
    warm_up = log.index("warm-up: a 8-token prefill and a decode step took")
    assert log.index("kernels: rms_norm=") < warm_up < log.index("engine ready:")


def test_a_model_that_cannot_load_stops_start_up_with_the_reason(tmp_path):
    model = tmp_path / "broken-model"
    model.mkdir()
    (model / "config.json").write_text("{not json")  # passes the config check, fails to load
    server = ServerProcess(["--model.source", str(model)], tmp_path / "server.log")
    assert server.proc.wait(timeout=120) == 1
    server.stop()
    log = server.log()
    assert "fd-serve: error:" in log and "broken-model/config.json" in log
    assert "Traceback" not in log and "never retrieved" not in log


@pytest.mark.usefixtures("demo_plugins")
def test_a_native_crash_during_start_up_names_the_signal_and_the_stage(tiny_model, tmp_path):
    """fd-other-plugins' ``sigill`` platform kills its engine process with a real SIGILL."""
    server = ServerProcess(["--model.source", str(tiny_model), "--platform.name", "sigill"], tmp_path / "server.log")
    assert server.proc.wait(timeout=120) == 1
    server.stop()
    log = server.log()
    assert (f"fd-serve: error: the engine process died during start-up (loading the model {str(tiny_model)!r}): "
            "SIGILL: illegal instruction — a kernel uses a CPU feature this machine lacks") in log
