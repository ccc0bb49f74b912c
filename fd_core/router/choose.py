"""The selection rule: which backend takes the next request.

A backend can take requests when its last ``/health`` said ``ok`` or ``degraded`` and its role
is ``mixed`` or ``decode`` (a decode instance has the prompt computed by a prefill instance
itself; a ``prefill`` instance only ever serves decode instances). Among those, the least
loaded wins, by :func:`score`; ties go round-robin, starting after the backend chosen last.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from fd_core.router.backends import Backend

#: ``/health`` statuses of a backend that serves what reaches it.
HEALTHY: Final = frozenset({"ok", "degraded"})
#: Roles the router sends requests to.
SERVING_ROLES: Final = frozenset({"mixed", "decode"})


def score(backend: Backend) -> int:
    """The backend's load: requests the router has in flight to it + its reported waiting + running.

    The reported figures are as old as the last poll; the router's own count is live, so requests
    arriving together spread even between two polls.
    """
    load = backend.load or {}
    return backend.in_flight + int(load.get("waiting", 0)) + int(load.get("running", 0))


def why_out(backend: Backend) -> str | None:
    """Why ``backend`` cannot take a request now, or None when it can."""
    if backend.status not in HEALTHY:
        return f"{backend.status}: {backend.reason}" if backend.reason else backend.status
    if backend.role not in SERVING_ROLES:
        return f"role {backend.role}: the router sends requests only to mixed and decode instances"
    return None


def choose(backends: Sequence[Backend], *, exclude: Collection[Backend] = (), after: int = 0) -> Backend | None:
    """The backend to send a request to, or None when none can take it.

    ``exclude``: backends already tried for this request. ``after``: the position (in
    ``backends``) where the round-robin among equally loaded backends starts.
    """
    n = len(backends)
    best: Backend | None = None
    best_key: tuple[int, int] = (0, 0)
    for position, backend in enumerate(backends):
        if backend in exclude or why_out(backend) is not None:
            continue
        key = (score(backend), (position - after) % n)
        if best is None or key < best_key:
            best, best_key = backend, key
    return best
