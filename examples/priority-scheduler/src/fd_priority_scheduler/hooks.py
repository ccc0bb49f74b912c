"""The priority hooks: admit lower ``Request.priority`` first, preempt the worst-priority request.

Registered through the ``fd.plugins`` entry-point group (see pyproject.toml), this module answers
two ``firstresult`` decision hooks of ``fd_core.hookspecs``:

* ``fd_order_waiting`` — asked by the request scheduler (``local``, ``splitwise``) each time the
  engine takes new requests: lower priority value first, earlier arrival among equals.
* ``fd_select_preemption_victim`` — asked by the ``v1`` resource manager when the KV pool runs
  dry: the running request of the worst priority, the latest arrival among equals.

Both return ``None`` (the built-in decision) while every request they are shown has the same
priority, so installing the plugin changes nothing for clients that never set one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import fd_core

if TYPE_CHECKING:
    from fd_core.request import Request

#: Checked by the registry when the plugin is loaded: a core with incompatible hooks refuses it by name.
fd_hookspec_version = fd_core.FD_HOOKSPEC_VERSION


@fd_core.hookimpl
def fd_order_waiting(waiting: list[Request], now: float) -> list[Request] | None:
    """Lower ``priority`` first, then earlier ``arrival_time``; ``None`` when all priorities are equal.

    The answer must be a permutation of ``waiting`` (a sorted copy is). Deferring on equal
    priorities keeps the built-in order there, which also lets the ``n`` choices of one call
    take turns with other calls.
    """
    if _one_priority(waiting):
        return None
    return sorted(waiting, key=lambda r: (r.priority, r.arrival_time))


@fd_core.hookimpl
def fd_select_preemption_victim(running: list[Request], needed_by: Request) -> Request | None:
    """The running request with the worst (highest) ``priority``; the latest arrival among those.

    ``v1`` asks on behalf of ``needed_by``, a running request that needs blocks, so the worst
    of ``running`` is never of better priority than ``needed_by``: when every other request is
    better, ``needed_by`` preempts itself and waits. Only a manager that asks for a request not
    in ``running`` could get a better one, and only because nothing else is left to take.
    Liveness: the best, earliest request is never the victim while another runs, so it
    finishes; with equal priorities the built-in choice (the last admitted) applies.
    """
    if _one_priority(running):
        return None
    # reversed: among exact ties, the one admitted last (the built-in default's choice)
    return max(reversed(running), key=lambda r: (r.priority, r.arrival_time))


def _one_priority(requests: list[Request]) -> bool:
    return len({r.priority for r in requests}) <= 1
