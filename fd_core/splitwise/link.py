"""The hand-off thread: the only thread that touches the connector.

It waits in ``connector.receive`` (at most one heartbeat), hands each delivery to its side
(:meth:`LinkSide.on_delivery`), runs the side's timers once per heartbeat
(:meth:`LinkSide.on_heartbeat`), and runs the calls that the engine thread queued with
:meth:`Link.call` (``connector.wake`` makes a blocked receive return for them at once).

It also answers ``FLUSH`` itself: an instance shutting down sends one to each peer it just said
goodbye to (``ABORT``) and closes its connector once each answered ``FLUSHED`` or the linger
passed, so its last messages are not dropped with its sockets.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Protocol

from fd_core.splitwise import protocol

if TYPE_CHECKING:
    from fd_core.contracts.connector import Connector, Delivery

log = logging.getLogger(__name__)


class LinkSide(Protocol):
    """What the link thread drives: the prefill or the decode side of the hand-off."""

    def on_delivery(self, delivery: Delivery) -> None: ...

    def on_heartbeat(self, now: float) -> None: ...


class Link:
    """Runs ``side`` on its own thread over ``connector`` until :meth:`close`."""

    def __init__(self, connector: Connector, side: LinkSide, *, heartbeat_s: float) -> None:
        self.connector = connector
        self._side = side
        self._heartbeat_s = heartbeat_s
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fd-handoff", daemon=True)
        self._flush_peers: Collection[str] = ()
        self._linger_s = 0.0
        self.address = ""

    def start(self) -> str:
        """Bind the connector and start the thread; returns this instance's address."""
        self.address = self.connector.start()
        self._thread.start()
        return self.address

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the link thread soon (from any thread)."""
        self._calls.put(fn)
        self.connector.wake()

    @property
    def closed(self) -> bool:
        return self._stop.is_set()

    def close(self, flush: Collection[str] = (), linger_s: float = 0.0) -> None:
        """Stop the thread after the calls queued so far; then wait up to ``linger_s`` for each peer
        in ``flush`` to confirm that everything sent to it arrived; then close the connector. A
        second call does nothing."""
        if self.closed:
            return
        self._flush_peers, self._linger_s = flush, linger_s
        self._stop.set()
        self.connector.wake()
        if self._thread.is_alive():
            self._thread.join(timeout=5 + linger_s)
        self.connector.close()

    def _run(self) -> None:
        next_beat = time.monotonic() + self._heartbeat_s
        while not self._stop.is_set():
            try:
                delivery = self.connector.receive(max(0.0, next_beat - time.monotonic()))
                if delivery is not None and not self._answered_flush(delivery):
                    self._side.on_delivery(delivery)
                self._run_calls()
                now = time.monotonic()
                if now >= next_beat:
                    self._side.on_heartbeat(now)
                    next_beat = now + self._heartbeat_s
            except Exception:  # one bad message or peer must not end every hand-off of this instance
                log.exception("the hand-off thread failed on one message; it goes on")
        try:
            self._run_calls()   # what close() queued last (goodbyes to peers)
            self._flush()
        except Exception:
            log.exception("the hand-off thread failed while stopping")

    def _answered_flush(self, delivery: Delivery) -> bool:
        """Answer a peer's FLUSH (True), or leave the delivery to the side (False)."""
        if delivery.message.get("kind") != protocol.FLUSH:
            return False
        self.connector.send(delivery.sender, {"kind": protocol.FLUSHED})
        return True

    def _flush(self) -> None:
        """Wait until every peer in ``_flush_peers`` confirmed (FLUSHED) or ``_linger_s`` passed;
        what else arrives meanwhile is dropped, but FLUSHes of peers also stopping are answered."""
        waiting = {peer for peer in self._flush_peers if self.connector.send(peer, {"kind": protocol.FLUSH})}
        deadline = time.monotonic() + self._linger_s
        while waiting and (left := deadline - time.monotonic()) > 0:
            delivery = self.connector.receive(left)
            if delivery is not None and not self._answered_flush(delivery) \
                    and delivery.message.get("kind") == protocol.FLUSHED:
                waiting.discard(delivery.sender)
        if waiting:
            log.info("closing the hand-off connector before %d peer(s) confirmed its last messages within "
                     "%.1f s: %s", len(waiting), self._linger_s, ", ".join(sorted(waiting)))

    def _run_calls(self) -> None:
        while True:
            try:
                fn = self._calls.get_nowait()
            except queue.Empty:
                return
            fn()
