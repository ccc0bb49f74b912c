"""Run the OpenAI-compatible server for a validated config until SIGTERM or SIGINT.

On the signal the server drains: new requests get 503, the listening socket closes, requests
in flight finish (bounded by ``server.shutdown_timeout_s``), then the engine process stops and
``serve`` returns 0. It returns 1 when the engine cannot start, and 3 when the engine process
died while serving (after ``server.exit_after_engine_death_s``), so that a supervisor restarts it.
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:
    from types import FrameType

    from fd_core.config import FdConfig
    from fd_core.server.state import ServerState


def serve(config: FdConfig) -> int:
    """Serve until told to stop; returns the exit code."""
    from fd_core.server.app import create_app

    root = logging.getLogger()
    log_level = logging.getLevelName(root.getEffectiveLevel())
    exit_code = 0

    def on_fatal(message: str, code: int) -> None:
        nonlocal exit_code
        print(f"fd-serve: error: {message}", file=sys.stderr, flush=True)
        exit_code = code
        server.should_exit = True

    app = create_app(config, on_fatal=on_fatal, log_level=log_level)
    server = _Server(uvicorn.Config(
        app, host=config.server.host, port=config.server.port, lifespan="on",
        log_level=log_level.lower(), access_log=root.isEnabledFor(logging.DEBUG),
        timeout_graceful_shutdown=config.server.shutdown_timeout_s), app.state.fd)
    url = f"http://{_url_host(config.server.host)}:{config.server.port}"
    print(f"fd-serve: serving {app.state.fd.model_name!r} at {url}/v1 "
          f"(loading the model; {url}/health answers 200 once it is ready)", flush=True)
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind
        return exc.code if isinstance(exc.code, int) else 1
    return exit_code


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
