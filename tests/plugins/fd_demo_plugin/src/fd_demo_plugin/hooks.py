"""General plugin: admits waiting requests by ascending ``priority`` (then arrival)."""

from __future__ import annotations

import fd_core

fd_hookspec_version = fd_core.FD_HOOKSPEC_VERSION


@fd_core.hookimpl
def fd_order_waiting(waiting, now):
    return sorted(waiting, key=lambda r: (r.priority, r.arrival_time))
