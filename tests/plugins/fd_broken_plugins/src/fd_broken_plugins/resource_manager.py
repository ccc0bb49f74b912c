"""A resource manager that leaks one KV block (breaks "no block leaks or double frees")."""

from __future__ import annotations

from typing import ClassVar

import fd_core
from fd_plugins.resource_managers.v1.manager import V1ResourceManager


class LeaksBlocks(V1ResourceManager):
    """v1, except that the first request it releases keeps its last block forever."""

    name: ClassVar[str] = "leaks-blocks"
    fd_hookspec_version: ClassVar[int] = fd_core.FD_HOOKSPEC_VERSION

    _leaked = False

    def _release(self, request: fd_core.Request) -> None:
        table = self.tables.get(request.request_id)
        if table is not None and table.blocks and not self._leaked:
            self._leaked = True
            table.blocks.pop()   # never given back to the pool
            table.ids.pop()
        super()._release(request)
