"""Start real ``fd-serve`` processes on 127.0.0.1 for the server tests, and stop them afterwards.

The tiny-model server (``tiny_server``) is shared by the module that uses it; tests that kill
or stop a server start their own with :func:`start_server`. The default-model server needs the
~98 MB model once; it is cached under ``$FD_CACHE_DIR`` (default ``~/.cache/fd-engine``), which
the subprocesses inherit.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from fd_core.testing.tiny_model import make_tiny_llama

#: How long a server may take to answer /health with 200 (the default model loads in ~10 s).
START_TIMEOUT_S = 180.0
#: Config of the tiny-model servers: small limits so the over-length and load tests stay fast.
TINY_ARGS = ("--model.max_model_len", "512", "--cache.num_blocks", "512", "--engine.max_num_seqs", "32",
             "--engine.max_num_batched_tokens", "512")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One ``fd-serve`` subprocess; its output goes to ``log_path``."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("FD_") or k == "FD_CACHE_DIR"}
        full_env.update(env or {})
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(self._command(["--server.port", str(self.port), *args]),
                                     stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    def _command(self, args: list[str]) -> list[str]:
        """The command line that runs fd-serve with ``args``."""
        return [sys.executable, "-m", "fd_core.cli", *args]

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fd-serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"fd-serve was not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def engine_pid(self) -> int:
        """The engine process: the child that is not multiprocessing's resource tracker."""
        return self.engine_pids()[0]

    def engine_pids(self) -> list[int]:
        """Every engine process (one per data-parallel rank), oldest first."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        pids = [pid for pid in map(int, children)
                if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes()]
        if not pids:
            raise RuntimeError(f"no engine process among the children {children} of {self.proc.pid}")
        return pids

    def stop(self) -> int:
        """SIGTERM, wait, and return the exit code (kill if it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def start_server(tmp_path: Path, *args: str, name: str = "server") -> ServerProcess:
    server = ServerProcess(list(args), tmp_path / f"{name}.log")
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", vocab=512, max_position_embeddings=512)


@pytest.fixture(scope="module")
def tiny_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A tiny-model server with an API key (``sk-test``), shared by one test module."""
    server = start_server(tmp_path_factory.mktemp("server"), "--model.source", str(tiny_model), *TINY_ARGS,
                          "--server.api_key", "sk-test")
    yield server
    assert server.stop() == 0, server.log()
