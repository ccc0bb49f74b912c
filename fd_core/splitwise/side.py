"""What the prefill and decode sides share: the link thread, the lock, publishing, counters."""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from fd_core.splitwise import protocol
from fd_core.splitwise.link import Link
from fd_core.splitwise.roles import EngineHandoff

if TYPE_CHECKING:
    from fd_core.config import SplitwiseSection
    from fd_core.contracts.connector import Connector
    from fd_core.contracts.scheduler import PeerDirectory, PeerInfo


class LinkedSide(EngineHandoff):
    """A side of the hand-off with its link thread; state shared by both threads is under ``_lock``."""

    def __init__(self, *, connector: Connector, directory: PeerDirectory, settings: SplitwiseSection,
                 me: PeerInfo) -> None:
        self.connector = connector
        self.directory = directory
        self.settings = settings
        self.me = me
        self._lock = threading.Lock()
        self._link = Link(connector, self, heartbeat_s=settings.heartbeat_s)
        self._counters: Counter[str] = Counter()
        self._wake_engine: Callable[[], None] = lambda: None

    def start(self, wake_engine: Callable[[], None]) -> None:
        self._wake_engine = wake_engine
        address = self._link.start()
        self.me = dataclasses.replace(self.me, address=address)
        self.directory.join(self.me)

    def close(self) -> None:
        """Say goodbye (``ABORT``) to the peers of every open hand-off, then stop; the connector is
        closed once each peer confirmed that the goodbyes arrived, or after 2 x ``heartbeat_s``."""
        if self._link.closed:
            return
        self._link.close(flush=self._say_goodbye(), linger_s=2 * self.settings.heartbeat_s)

    def _say_goodbye(self) -> set[str]:
        """Queue an ``ABORT`` for every open hand-off (on the link thread); returns the peers' addresses."""
        return set()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            figures: dict[str, Any] = dict(self._counters)
        figures.update({f"connector_{key}": value for key, value in self.connector.stats().items()})
        return figures

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counters[key] += n

    # --- link thread -------------------------------------------------------------------------

    def _send(self, peer: str, kind: str, buffers: Sequence[memoryview] = (), **fields: Any) -> bool:
        sent = self.connector.send(peer, {"kind": kind, **fields}, buffers)
        if not sent:
            self._count("messages_not_taken")
        return sent

    def _send_alive(self, open_by_peer: dict[str, list[list[Any]]]) -> None:
        for peer, open_ids in open_by_peer.items():
            self._send(peer, protocol.ALIVE, open=open_ids)
