"""Run the OpenAI-compatible server for a validated config until SIGTERM or SIGINT.

On the signal the server drains: the listening socket closes, new requests on open connections
get 503 with ``Connection: close`` (the connections stay open while requests are in flight),
requests in flight finish, then the engine process stops and ``serve`` returns 0. Requests still in
flight after ``server.shutdown_timeout_s`` are answered with 503 (:mod:`fd_core.server.drain`);
uvicorn's own timeout, which would cut them off, comes :data:`SHUTDOWN_GRACE_S` later. ``serve``
returns 1 when the engine cannot start, and 3 when the engine process died while serving
(after ``server.exit_after_engine_death_s``), so that a supervisor restarts it. The listening
socket is bound first of all: a busy port is one error line and ``ExitCode.CANNOT_LISTEN``, before the engine
process (and its model load) is started.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from typing import TYPE_CHECKING, Final

import uvicorn

from fd_core.exit_codes import ExitCode
from fd_core.server.connections import uvicorn_options

if TYPE_CHECKING:
    from types import FrameType

    from fd_core.config import FdConfig
    from fd_core.server.state import ServerState

#: How long after ``server.shutdown_timeout_s`` uvicorn cancels what is left (what the drain
#: could not answer: a stream whose client stopped reading it).
SHUTDOWN_GRACE_S: Final = 5.0
#: How often the drain looks whether requests are still in flight (uvicorn's own pace), in seconds.
DRAIN_POLL_S: Final = 0.1


def serve(config: FdConfig) -> int:
    """Serve until told to stop; returns the exit code."""
    from fd_core.server.app import create_app

    try:
        listener = bind_listener(config.server.host, config.server.port)
    except OSError as exc:
        print(f"fd-serve: error: cannot listen on {_url_host(config.server.host)}:{config.server.port} "
              f"(server.host, server.port): {exc.strerror or exc}; choose another --server.port",
              file=sys.stderr, flush=True)
        return ExitCode.CANNOT_LISTEN
    root = logging.getLogger()
    log_level = logging.getLevelName(root.getEffectiveLevel())
    exit_code: int = ExitCode.OK

    def on_fatal(message: str, code: int) -> None:
        nonlocal exit_code
        print(f"fd-serve: error: {message}", file=sys.stderr, flush=True)
        exit_code = code
        server.should_exit = True

    app = create_app(config, on_fatal=on_fatal, log_level=log_level)
    server = _Server(uvicorn.Config(
        app, host=config.server.host, port=config.server.port, lifespan="on",
        log_level=log_level.lower(), access_log=root.isEnabledFor(logging.DEBUG),
        timeout_graceful_shutdown=config.server.shutdown_timeout_s + SHUTDOWN_GRACE_S,
        **uvicorn_options(config.server.max_header_bytes, "server.max_header_bytes")), app.state.fd)
    url = f"http://{_url_host(config.server.host)}:{listener.getsockname()[1]}"
    print(f"fd-serve: serving {app.state.fd.model_name!r} at {url}/v1 "
          f"(loading the model; {url}/health answers 200 once it is ready)", flush=True)
    server.run(sockets=[listener])
    return exit_code


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's listening TCP socket (IPv6 when ``host`` is an IPv6 address); raises OSError.

    Made with protocol ``IPPROTO_TCP``, not 0: asyncio sets ``TCP_NODELAY`` only on accepted
    sockets whose protocol says TCP, and without it every response after the first on a keep-alive
    connection waited ~40 ms (Nagle's algorithm against the client's delayed ACK)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(2048)
    except OSError:
        listener.close()
        raise
    return listener


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class _Server(uvicorn.Server):
    """A uvicorn server whose signal handler starts the drain and lets the process exit 0."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self._state = state

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded the way uvicorn records it: uvicorn would re-raise the signal after a
        # graceful shutdown, and the process would die of SIGTERM instead of exiting 0.
        self._state.draining = True
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl+C stops waiting for requests in flight
        else:
            self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._state.drain.start()  # the requests in flight have server.shutdown_timeout_s from now
        self._state.client.drain()  # a pool member takes no more work from its peers
        self._stop_listening(sockets)
        await self._let_requests_finish()
        await super().shutdown(sockets)  # closes the connections left (idle by now) and waits for the rest

    def _stop_listening(self, sockets: list[socket.socket] | None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()

    async def _let_requests_finish(self) -> None:
        """Wait until no generation request is in flight, the drain's deadline passed (it answers
        them then) or a second Ctrl+C came, with the open connections kept: a request that arrives
        on a kept-alive one meanwhile gets the documented 503 (uvicorn would have closed them)."""
        loop = asyncio.get_running_loop()
        deadline = self._state.drain.deadline
        assert deadline is not None, "the drain started"
        while self._state.in_flight and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
