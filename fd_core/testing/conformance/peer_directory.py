"""An in-memory peer directory, so that two engines in one process pair up without Redis.

The hand-off needs a scheduler that is also a :class:`~fd_core.contracts.scheduler.PeerDirectory`;
the built-in ``splitwise`` one keeps the directory in Redis. :func:`directory_scheduler` turns any
scheduler class (the kit uses the installed ``local`` one) into such a scheduler whose directory
is a :class:`PeerBoard` shared by every instance of the returned class: give both engines of a
test registries holding that one class. It passes the scheduler kit itself
(``check_scheduler(directory_scheduler(LocalScheduler))``).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, ClassVar, Final

from fd_core.contracts.scheduler import PeerDirectory, PeerInfo

if TYPE_CHECKING:
    from fd_core.contracts.scheduler import Scheduler

__all__ = ["DIRECTORY_NAME", "InMemoryPeerDirectory", "PeerBoard", "directory_scheduler"]

#: The scheduler name the kit's engines select.
DIRECTORY_NAME: Final = "conformance-directory"


class PeerBoard:
    """Who is in the directory: instance id -> its latest :class:`PeerInfo`; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._peers: dict[str, PeerInfo] = {}

    def publish(self, info: PeerInfo) -> None:
        with self._lock:
            self._peers[info.instance_id] = info

    def remove(self, instance_id: str) -> None:
        with self._lock:
            self._peers.pop(instance_id, None)

    def listing(self) -> list[PeerInfo]:
        with self._lock:
            return list(self._peers.values())


class InMemoryPeerDirectory(PeerDirectory):
    """The directory half: join, loads and listings on the class's :attr:`board`.

    Mixed in before a Scheduler class (see :func:`directory_scheduler`); :meth:`close` leaves the
    board, then closes the scheduler.
    """

    #: The board every instance of the class shares.
    board: ClassVar[PeerBoard]
    _me: PeerInfo | None = None   # set by join

    def join(self, me: PeerInfo) -> None:
        self._me = me
        self.board.publish(me)

    def report_load(self, load: int) -> None:
        me = self._me
        if me is not None:
            self._me = dataclasses.replace(me, load=load)
            self.board.publish(self._me)

    def peers(self, role: str) -> list[PeerInfo]:
        mine = None if self._me is None else self._me.instance_id
        return sorted((p for p in self.board.listing() if p.role == role and p.instance_id != mine),
                      key=lambda p: (p.load, p.instance_id))

    def close(self) -> None:
        if self._me is not None:
            self.board.remove(self._me.instance_id)
        super().close()  # type: ignore[misc]   # the scheduler's, next in the MRO


def directory_scheduler(base: type[Scheduler], board: PeerBoard | None = None, *,
                        name: str = DIRECTORY_NAME) -> type[Scheduler]:
    """A subclass of ``base`` that is also an in-memory PeerDirectory on ``board`` (a new one by
    default), registered as ``name``."""
    cls = type(f"InMemoryDirectory{base.__name__}", (InMemoryPeerDirectory, base),
               {"board": board or PeerBoard(), "name": name, "__module__": __name__,
                "__doc__": f"{base.__name__} with an in-memory peer directory (conformance kit)."})
    return cls  # type: ignore[return-value]
