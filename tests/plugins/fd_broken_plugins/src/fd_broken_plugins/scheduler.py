"""A scheduler that silently drops every eighth request put (breaks "handed out exactly once or answered")."""

from __future__ import annotations

from typing import ClassVar

import fd_core
from fd_plugins.schedulers.local import LocalScheduler


class DropsRequests(LocalScheduler):
    """The local queue, except that put_request forgets requests 7, 15, 23, ... without a word."""

    name: ClassVar[str] = "drops-requests"
    fd_hookspec_version: ClassVar[int] = fd_core.FD_HOOKSPEC_VERSION

    _puts = 0

    def put_request(self, request: fd_core.Request) -> None:
        self._puts += 1
        if self._puts % 8 == 0:
            return
        super().put_request(request)
