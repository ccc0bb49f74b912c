"""Start the OpenAI-compatible server for a validated config."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fd_core.errors import FdError

if TYPE_CHECKING:
    from fd_core.config import FdConfig


def serve(config: FdConfig) -> int:
    """Run the server until SIGTERM; returns the exit code."""
    from fd_core.selection import resolve

    resolve(config)
    raise FdError("no model runner yet: serving lands with the engine issues; use --check to validate")
