"""A token processor that looks for stop strings inside one token's text only (breaks "stop strings
match across tokens")."""

from __future__ import annotations

from typing import ClassVar

import fd_core
from fd_plugins.token_processors.default import DefaultTokenProcessor


class _PerTokenStops:
    """Matches a stop string only when a single delta contains all of it."""

    def __init__(self, stops: tuple[str, ...], include: bool) -> None:
        self.stops = stops
        self.include = include

    def feed(self, text: str, *, active: bool) -> tuple[str, bool]:
        if active:
            for stop in self.stops:
                at = text.find(stop)
                if at >= 0:
                    return text[:at + len(stop)] if self.include else text[:at], True
        return text, False

    def flush(self) -> str:
        return ""


class MissesSplitStops(DefaultTokenProcessor):
    """The default processor with a stop-string matcher that never looks across token boundaries."""

    name: ClassVar[str] = "misses-split-stops"
    fd_hookspec_version: ClassVar[int] = fd_core.FD_HOOKSPEC_VERSION

    def _new_state(self, request: fd_core.Request):  # type: ignore[no-untyped-def]
        state = super()._new_state(request)
        params = request.sampling_params
        stops = tuple(s for s in params.stop if s)
        state.stops = _PerTokenStops(stops, params.include_stop_str_in_output) if stops else None  # type: ignore[assignment]
        return state
