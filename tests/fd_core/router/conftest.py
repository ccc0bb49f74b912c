"""Real processes for the router tests: tiny-model fd-serve backends and ``fd-serve router`` itself.

The backend helpers are the server tests' (``ServerProcess``, ``TINY_ARGS``, the session-wide
``tiny_model``); :class:`RouterProcess` runs ``python -m fd_core.cli router`` on a free port.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fd_core.server.conftest import TINY_ARGS, ServerProcess, free_port, tiny_model  # noqa: F401 (fixture)

#: The API key of the backends; the router passes the client's Authorization header through.
API_KEY = "sk-test"
KEY = {"Authorization": f"Bearer {API_KEY}"}
#: How long a router may take to answer /health (it imports FastAPI and polls its backends once).
ROUTER_START_TIMEOUT_S = 60.0


class RouterProcess:
    """One ``fd-serve router`` subprocess over ``backends``; its output goes to ``log_path``."""

    def __init__(self, backends: Sequence[str], log_path: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {k: v for k, v in os.environ.items() if not k.startswith("FD_")}
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fd_core.cli", "router", "--router.port", str(self.port),
             "--router.backends", ",".join(backends), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait_answering(self, timeout: float = ROUTER_START_TIMEOUT_S) -> None:
        """Until /health answers at all (200 or 503: whether a backend is up is the test's business)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the router exited with {self.proc.returncode}:\n{self.log()}")
            try:
                httpx.get(self.url + "/health", timeout=2)
                return
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError(f"the router did not answer after {timeout} s:\n{self.log()}")

    def health(self) -> dict[str, Any]:
        return httpx.get(self.url + "/health", timeout=10).json()

    def backend(self, url: str) -> dict[str, Any]:
        """The router's /health entry of the backend at ``url``."""
        return next(entry for entry in self.health()["backends"] if entry["url"] == url)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> int:
        """SIGTERM, wait, and return the exit code (kill if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def start_backends(tmp_path: Path, model: Path, count: int = 2) -> list[ServerProcess]:
    """``count`` tiny-model fd-serve instances with API key :data:`API_KEY`, started side by side."""
    servers = [ServerProcess(["--model.source", str(model), *TINY_ARGS, "--server.api_key", API_KEY],
                             tmp_path / f"backend{i}.log") for i in range(count)]
    try:
        for server in servers:
            server.wait_ready()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def start_router(tmp_path: Path, backends: Sequence[str], *args: str, name: str = "router") -> RouterProcess:
    router = RouterProcess(backends, tmp_path / f"{name}.log", *args)
    try:
        router.wait_answering()
    except BaseException:
        router.stop()
        raise
    return router


def kill_9(server: ServerProcess) -> None:
    """SIGKILL the backend's engine and front end, as a crash or the OOM killer would."""
    os.kill(server.engine_pid(), signal.SIGKILL)
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait()


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def backends(tiny_model: Path,  # noqa: F811 (the server tests' fixture, imported above)
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    """Two tiny-model backends shared by one test module (stopped, or already killed, at its end)."""
    servers = start_backends(tmp_path_factory.mktemp("backends"), tiny_model)
    yield servers
    for server in servers:
        server.stop()
