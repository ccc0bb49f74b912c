"""Run the router for a validated config until SIGTERM or SIGINT; returns the exit code.

The listening socket is bound first of all: a busy port is one error line and ``ExitCode.CANNOT_LISTEN``. On
SIGTERM the router stops accepting connections, lets the requests in flight finish for up to
``router.shutdown_timeout_s`` and returns 0 (a second Ctrl+C stops waiting).
"""

from __future__ import annotations

import logging
import signal
import sys
from typing import TYPE_CHECKING

import uvicorn

from fd_core.exit_codes import ExitCode
from fd_core.server.connections import uvicorn_options
from fd_core.server.main import bind_listener

if TYPE_CHECKING:
    from types import FrameType

    from fd_core.router.config import RouterConfig

#: Exit code of a port that cannot be listened on (a config problem, as for fd-serve).


def serve_router(config: RouterConfig) -> int:
    """Serve until told to stop; returns the exit code."""
    from fd_core.router.app import create_app

    settings = config.router
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    try:
        listener = bind_listener(settings.host, settings.port)
    except OSError as exc:
        print(f"fd-serve: error: cannot listen on {host}:{settings.port} (router.host, router.port): "
              f"{exc.strerror or exc}; choose another --router.port", file=sys.stderr, flush=True)
        return ExitCode.CANNOT_LISTEN
    root = logging.getLogger()
    log_level = logging.getLevelName(root.getEffectiveLevel()).lower()
    if not root.isEnabledFor(logging.DEBUG):  # httpx logs every request (a poll a second per backend) at INFO
        logging.getLogger("httpx").setLevel(logging.WARNING)
    server = _Server(uvicorn.Config(
        create_app(config), host=settings.host, port=settings.port, lifespan="on", log_level=log_level,
        access_log=root.isEnabledFor(logging.DEBUG), timeout_graceful_shutdown=settings.shutdown_timeout_s,
        **uvicorn_options(settings.max_header_bytes, "router.max_header_bytes")))
    url = f"http://{host}:{listener.getsockname()[1]}"
    print(f"fd-serve router: forwarding to {len(settings.backends)} backend(s) at {url}/v1 "
          f"({url}/health lists them)", flush=True)
    server.run(sockets=[listener])
    return ExitCode.OK


class _Server(uvicorn.Server):
    """A uvicorn server whose signal handler lets the process exit 0 after the graceful shutdown."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded the way uvicorn records it: uvicorn would re-raise the signal after the
        # shutdown, and the process would die of SIGTERM instead of exiting 0.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True
