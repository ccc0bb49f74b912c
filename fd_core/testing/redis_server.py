"""A real ``redis-server`` on a free loopback port, for tests of the ``global`` scheduler.

No persistence: a restart starts empty, like a Redis that lost its data. Usable from a plugin author's own tests::

    with RedisServer(tmp_path) as server:
        settings = {"url": server.url}
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Final

#: How long start-up may take before the server counts as broken.
START_TIMEOUT_S: Final = 10.0


def redis_server_path() -> str | None:
    """The ``redis-server`` executable on PATH, or None."""
    return shutil.which("redis-server")


class RedisServer:
    """One ``redis-server`` child process bound to 127.0.0.1 (or the addresses in ``bind``: the
    first is the one in :attr:`url`); :meth:`stop`, :meth:`start` again."""

    def __init__(self, folder: Path, port: int | None = None, *, bind: tuple[str, ...] = ("127.0.0.1",),
                 password: str | None = None, extra_args: tuple[str, ...] = ()) -> None:
        executable = redis_server_path()
        if executable is None:
            raise FileNotFoundError("redis-server is not on PATH (apt-get install redis-server)")
        self._executable = executable
        self.folder = folder
        self.port = port or _free_port()
        self.bind = bind
        self.password = password
        self.extra_args = extra_args   # more redis-server options ("--cluster-enabled", "yes"...)
        self.url = self.url_at(bind[0])
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisServer:
        """Start (again) on the same port; returns once it answers PING."""
        self.folder.mkdir(parents=True, exist_ok=True)
        log = (self.folder / "redis.log").open("ab")
        self._process = subprocess.Popen(
            [self._executable, "--port", str(self.port), "--bind", *self.bind, "--save", "", "--appendonly", "no",
             # clients come from the addresses it binds (test namespaces), not only loopback
             "--protected-mode", "no" if self.bind != ("127.0.0.1",) else "yes",
             "--dir", str(self.folder), *(("--requirepass", self.password) if self.password else ()),
             *self.extra_args], stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self._process.returncode}: "
                                   f"{(self.folder / 'redis.log').read_text()[-2000:]}")
            try:
                with socket.create_connection((self.bind[0], self.port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith((b"+PONG", b"-NOAUTH")):   # answering; a password is set
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {START_TIMEOUT_S} s")

    def url_at(self, host: str) -> str:
        """The redis-py URL of this server at one of its bind addresses (with its password)."""
        credentials = f":{self.password}@" if self.password else ""
        return f"redis://{credentials}{host}:{self.port}/0"

    def stop(self) -> None:
        """Kill the server (its data is gone)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._process = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
