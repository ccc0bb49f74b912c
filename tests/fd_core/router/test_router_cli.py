"""``fd-serve router`` on the command line: config mistakes by key, the config sources, help, a busy port,
and a router whose backends are all unreachable (no model needed)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fd_core.exit_codes import ExitCode
from tests.conftest import run_fd_serve
from tests.fd_core.router.conftest import start_router
from tests.fd_core.server.test_requests import metric, metrics

OK_BACKENDS = ("--router.backends", "http://127.0.0.1:8001,http://127.0.0.1:8002")

#: (arguments after ``router``, a part of the one error line).
MISTAKES = [
    ([], "router.backends: at least one backend is needed"),
    (["--router.backends", "ftp://x"], "router.backends.0: 'ftp://x' is not an http(s) URL of an fd-serve instance"),
    (["--router.backends", "http://a:1,localhost:8000"], "router.backends.1: 'localhost:8000' is not an http(s) URL"),
    (["--router.backends", "http://a:1,http://A:1/"],
     "router.backends: 'http://a:1' is listed twice (entries 0 and 1)"),
    (["--router.backends", "http://a:99999"], "router.backends.0: 'http://a:99999' is not a URL"),
    (["--port", "9100", *OK_BACKENDS], "unknown flag --port; did you mean --router.port?"),
    (["--router.prot", "9100"], "unknown flag --router.prot; did you mean --router.port?"),
    (["--router.port", "x", *OK_BACKENDS], "router.port: Input should be a valid integer"),
    (["--router.health_interval_s", "0", *OK_BACKENDS], "router.health_interval_s: Input should be greater than 0"),
    (["--config", "/no/such/router.toml"], "--config: file not found"),
    (["serve"], "unexpected argument 'serve'"),
]


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("WARNING ")]


@pytest.mark.parametrize(("args", "expected"), MISTAKES, ids=[" ".join(a) or "-" for a, _ in MISTAKES])
def test_a_config_mistake_is_one_line_naming_the_key_and_exit_2(args, expected):
    result = run_fd_serve("router", *args, timeout=60)
    assert "Traceback" not in result.stderr
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = _error_lines(result.stderr)
    assert line.startswith("fd-serve: error: ") and expected in line, line
    assert "forwarding" not in result.stdout


def test_every_problem_is_reported_at_once():
    result = run_fd_serve("router", "--router.port", "-1", "--router.backends", "http://a:1,http://a:1",
                          "--router.max_concurrency", "0")
    assert result.returncode == 2
    keys = [line.split(": ")[2] for line in _error_lines(result.stderr)]
    assert keys == ["router.port", "router.backends", "router.max_concurrency"]


def test_the_toml_file_env_and_flags_combine_strongest_first(tmp_path: Path):
    path = tmp_path / "router.toml"
    path.write_text('[router]\nbackends = ["http://10.0.0.1:8000/", "HTTP://10.0.0.2:8000"]\nport = 9100\n'
                    "health_interval_s = 0.5\nrequest_timeout_s = 60\n")
    result = run_fd_serve("router", "--config", str(path), "--router.port", "9200", "--check",
                          env={"FD_ROUTER__HEALTH_INTERVAL_S": "0.25"})
    assert result.returncode == 0, result.stderr
    resolved = json.loads(result.stdout)["router"]
    assert resolved["backends"] == ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]  # normalised
    assert resolved["port"] == 9200 and resolved["health_interval_s"] == 0.25 and resolved["request_timeout_s"] == 60
    assert resolved["host"] == "127.0.0.1" and resolved["max_concurrency"] > 0

    path.write_text('[router]\nbackends = ["http://10.0.0.1:8000"]\nbakends = []\n')
    result = run_fd_serve("router", "--config", str(path), "--check")
    assert result.returncode == 2
    assert _error_lines(result.stderr) == ["fd-serve: error: router.bakends: Extra inputs are not permitted"]
    result = run_fd_serve("router", *OK_BACKENDS, "--check", env={"FD_ROUTER__PORT": "x"})
    assert result.returncode == 2 and "router.port: " in result.stderr and "(from FD_ROUTER__PORT)" in result.stderr


def test_help_lists_the_routers_keys():
    from fd_core.cli_usage import router_help_text

    shown = run_fd_serve("router", "--help")
    assert shown.returncode == 0 and shown.stdout == router_help_text() + "\n"
    assert shown.stdout.startswith("usage: fd-serve router ")
    for key in ("--router.backends", "--router.port INT", "--router.health_interval_s FLOAT",
                "--router.connect_timeout_s", "--router.request_timeout_s", "--router.max_concurrency"):
        assert key in shown.stdout
    assert "(default: 9000)" in shown.stdout and "(default: 1800.0)" in shown.stdout
    assert "fd-serve router" in run_fd_serve("--help").stdout


def test_a_busy_port_is_one_line_and_its_own_exit_code():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_fd_serve("router", "--router.port", str(port), *OK_BACKENDS, timeout=60)
    assert result.returncode == ExitCode.CANNOT_LISTEN, result.stdout + result.stderr
    [line] = _error_lines(result.stderr)
    assert line.startswith(f"fd-serve: error: cannot listen on 127.0.0.1:{port} (router.host, router.port): ")
    assert "Traceback" not in result.stderr


@pytest.fixture
def closed_ports() -> Iterator[list[str]]:
    """Two URLs whose ports are bound but not listening: every connect is refused."""
    sockets = [socket.socket() for _ in range(2)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    yield [f"http://127.0.0.1:{sock.getsockname()[1]}" for sock in sockets]
    for sock in sockets:
        sock.close()


def test_with_no_backend_reachable_every_request_gets_503_no_backend(tmp_path, closed_ports):
    router = start_router(tmp_path, closed_ports)
    try:
        health = httpx.get(router.url + "/health", timeout=10)
        assert health.status_code == 503
        body = health.json()
        assert body["status"] == "unavailable" and [e["url"] for e in body["backends"]] == closed_ports
        for entry in body["backends"]:
            assert entry["status"] == "down" and entry["reason"] == "cannot connect: [Errno 111] connection refused"
        response = httpx.post(router.url + "/v1/chat/completions", json={"messages": [], "stream": True}, timeout=10)
        assert response.status_code == 503
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "no_backend"
        assert error["message"].startswith("no backend can take the request: ")
        for url in closed_ports:
            assert f"{url} (down: cannot connect: [Errno 111] connection refused)" in error["message"]
        assert httpx.get(router.url + "/v1/models", timeout=10).status_code == 503
        text = metrics(router.url)
        assert metric(text, "fd_router_no_backend_total") == 2
        assert metric(text, "fd_router_backend_up", f'{{backend="{closed_ports[0]}",role="unknown"}}') == 0
    finally:
        assert router.stop() == 0, router.log()


def test_a_misspelt_router_command_is_pointed_at():
    result = run_fd_serve("routr", "--router.port", "9100")
    assert result.returncode == 2
    assert _error_lines(result.stderr) == [
        "fd-serve: error: unexpected argument 'routr' (did you mean: fd-serve router?) (see fd-serve --help)"]
