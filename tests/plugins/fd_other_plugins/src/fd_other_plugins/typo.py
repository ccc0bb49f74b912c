"""A general plugin whose hook name is misspelt: pluggy would register it and never call it."""

from __future__ import annotations

import fd_core

fd_hookspec_version = fd_core.FD_HOOKSPEC_VERSION


@fd_core.hookimpl
def fd_order_wating(waiting, now):  # sic: fd_order_waiting
    return list(reversed(waiting))
