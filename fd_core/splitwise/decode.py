"""The decode side of the hand-off: reserve, ask a prefill instance, take the KV, decode on.

See :mod:`fd_core.splitwise` for the protocol. The engine thread reserves blocks and hands the
request to the link thread, which picks the prefill instance, writes arriving blocks into the
reserved blocks (under the lock, so that a cancel never races a write) and reports the first
token back; the core then emits it and the request decodes like any other.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from fd_core.outputs import SampledToken
from fd_core.request import FinishReason
from fd_core.server import wire
from fd_core.splitwise import protocol
from fd_core.splitwise.roles import HandoffEvents
from fd_core.splitwise.side import LinkedSide

if TYPE_CHECKING:
    from collections.abc import Callable, Collection

    from fd_core.contracts.connector import Delivery
    from fd_core.contracts.resource_manager import ResourceManager
    from fd_core.contracts.scheduler import PeerInfo
    from fd_core.outputs import StepPlan
    from fd_core.request import Request
    from fd_core.splitwise.kv_blocks import KVBlockViews

log = logging.getLogger(__name__)
#: Seconds between two log lines about messages from a sender other than the prefill instance asked.
REFUSAL_LOG_EVERY_S = 10.0


@dataclass(slots=True, eq=False)
class _Transfer:
    """One reserved request waiting for its prompt KV."""

    request: Request
    blocks: list[int]                   # the reserved block ids, in position order
    heard: float                        # last message from the prefill side (monotonic)
    started: float
    attempt: int = 0
    peer: PeerInfo | None = None
    tried: list[str] = field(default_factory=list)   # instance ids asked so far
    written: set[int] = field(default_factory=set)  # block indexes written in this attempt
    unplaced_since: float | None = None  # no prefill instance to ask since (monotonic)
    first_block: float | None = None     # when this attempt's first block arrived (monotonic)
    last_failure: str | None = None


class DecodeSide(LinkedSide):
    """Reserves blocks, has prompts computed elsewhere, and decodes on (``splitwise.role = "decode"``)."""

    role: ClassVar[str] = "decode"

    def __init__(self, *, resource_manager: ResourceManager, kv: KVBlockViews, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.resource_manager = resource_manager
        self.kv = kv
        self._waiting_for_room: deque[Request] = deque()   # engine thread only
        self._transfers: dict[str, _Transfer] = {}          # under the lock
        self._arrived: list[tuple[Request, SampledToken]] = []
        self._failed: list[tuple[Request, FinishReason, str | None]] = []
        self._next_refusal_log = 0.0   # under the lock
        self._counters["messages_from_another_peer"] = 0   # listed at 0: an alert on it needs no "absent" rule

    # --- engine thread -------------------------------------------------------------------------

    def admit(self, request: Request) -> bool:
        self._waiting_for_room.append(request)
        self._reserve_waiting()
        return True

    def poll(self, room: int) -> HandoffEvents:
        self._reserve_waiting()
        with self._lock:
            events = HandoffEvents(first_tokens=self._arrived, ends=self._failed)
            self._arrived, self._failed = [], []
        return events

    def has_events(self) -> bool:
        with self._lock:
            return bool(self._arrived or self._failed)

    def planned(self, plan: StepPlan) -> None:
        for request_id in plan.preempted_ids:   # it recomputes its prompt here instead
            if self._cancel(request_id, "preempted on the decode side"):
                self._count("transfers_preempted")

    def forget(self, request_id: str) -> None:
        self._cancel(request_id, "the request ended on the decode side")
        for request in self._waiting_for_room:
            if request.request_id == request_id:
                self._waiting_for_room.remove(request)
                break

    def stats(self) -> dict[str, Any]:
        figures = super().stats()
        with self._lock:
            figures["transfers_open"] = len(self._transfers)
        figures["waiting_for_blocks"] = len(self._waiting_for_room)
        return figures

    def _say_goodbye(self) -> set[str]:
        """Tell the prefill side of every open hand-off to free its blocks."""
        with self._lock:
            transfers = list(self._transfers.values())
        peers = {transfer.peer.address for transfer in transfers if transfer.peer is not None}
        for transfer in transfers:
            self._cancel(transfer.request.request_id, "the decode instance is shutting down")
        return peers

    def _reserve_waiting(self) -> None:
        """Reserve blocks for waiting requests in order; the first that does not fit waits on."""
        while self._waiting_for_room:
            request = self._waiting_for_room[0]
            blocks = self.resource_manager.reserve(request)
            if blocks is None:
                return
            self._waiting_for_room.popleft()
            now = time.monotonic()
            transfer = _Transfer(request, blocks, heard=now, started=now)
            with self._lock:
                self._transfers[request.request_id] = transfer
            self._link.call(lambda t=transfer: self._ask_next(t, None))

    def _cancel(self, request_id: str, reason: str) -> bool:
        with self._lock:   # waits for a block write in progress: none follows
            transfer = self._transfers.pop(request_id, None)
        if transfer is None:
            return False
        peer = transfer.peer
        if peer is not None:
            self._link.call(lambda: self._send(peer.address, protocol.ABORT, id=request_id,
                                               attempt=transfer.attempt, reason=reason))
        return True

    # --- link thread ---------------------------------------------------------------------------

    def on_delivery(self, delivery: Delivery) -> None:
        message = delivery.message
        kind = message["kind"]
        if kind == protocol.ALIVE:
            for transfer in self._hear_alive(message["open"], delivery.sender):
                self._retry(transfer, f"{self._peer_name(transfer)}: its DONE was lost on the way")
            return
        with self._lock:
            transfer = self._current(message.get("id", ""), message.get("attempt"))
            if transfer is None:
                return   # ended here, or a late message of an earlier attempt
            if not self._from_its_peer(transfer, delivery.sender):
                self._refuse_sender(delivery.sender, kind, transfer)
                return
            transfer.heard = time.monotonic()
            if kind == protocol.BLOCK:
                self._write(transfer, message["index"], delivery.buffers)
                return
        if kind == protocol.DONE:
            self._on_done(transfer, message)
        elif kind == protocol.ABORT:
            self._ask_next(transfer, f"{self._peer_name(transfer)}: {message['reason']}")

    def _hear_alive(self, open_entries: list[list[Any]], sender: str) -> list[_Transfer]:
        """Note that ``sender`` still has these hand-offs; returns those it says it sent DONE for
        although none arrived (messages between two instances arrive in order: it was lost). An
        entry naming a hand-off that ``sender`` was not asked for is ignored."""
        lost, foreign = [], None
        with self._lock:
            for request_id, attempt, *state in open_entries:
                transfer = self._current(request_id, attempt)
                if transfer is None:
                    continue
                if not self._from_its_peer(transfer, sender):
                    foreign = transfer
                    continue
                transfer.heard = time.monotonic()
                if state and state[0]:   # done_sent (an instance of an earlier version sends no state)
                    lost.append(transfer)
            if foreign is not None:   # counted once per ALIVE, however many of its entries are foreign
                self._refuse_sender(sender, protocol.ALIVE, foreign)
        return lost

    def on_heartbeat(self, now: float) -> None:
        stalled, unplaced, open_by_peer = [], [], {}
        with self._lock:
            for transfer in self._transfers.values():
                if transfer.peer is None:
                    unplaced.append(transfer)
                elif now - transfer.heard > self.settings.stall_timeout_s:
                    stalled.append(transfer)
                else:
                    open_by_peer.setdefault(transfer.peer.address, []).append(
                        [transfer.request.request_id, transfer.attempt])
        self._send_alive(open_by_peer)
        for transfer in unplaced:
            self._ask_next(transfer, None)
        for transfer in stalled:
            assert transfer.peer is not None
            self._abort_attempt(transfer, "no message for splitwise.stall_timeout_s")
            self.connector.forget_peer(transfer.peer.address)
            self._count("transfers_stalled")
            self._ask_next(transfer, f"{transfer.peer.instance_id}: silent for {self.settings.stall_timeout_s} s "
                                     "(splitwise.stall_timeout_s)")

    def _write(self, transfer: _Transfer, index: int, buffers: list[memoryview]) -> None:
        """Copy one block into its reserved block (caller holds the lock)."""
        if not 0 <= index < len(transfer.blocks):
            raise ValueError(f"block index {index} of {transfer.request.request_id!r} is outside its "
                             f"{len(transfer.blocks)} reserved blocks")
        self.kv.write(transfer.blocks[index], buffers)
        if transfer.first_block is None:
            transfer.first_block = time.monotonic()
        transfer.written.add(index)
        self._counters["blocks_received"] += 1
        self._counters["bytes_received"] += sum(b.nbytes for b in buffers)

    def _on_done(self, transfer: _Transfer, message: dict[str, Any]) -> None:
        assert transfer.peer is not None
        request_id = transfer.request.request_id
        missing = len(transfer.blocks) - len(transfer.written)
        if message["blocks"] != len(transfer.blocks) or missing:
            self._retry(transfer, f"{transfer.peer.instance_id}: {len(transfer.written)} of "
                                  f"{len(transfer.blocks)} blocks arrived before its DONE")
            return
        self._send(transfer.peer.address, protocol.ACK, id=request_id, attempt=transfer.attempt)
        token = wire.sampled_token(message["token"])
        # the prompt logprobs the request asks for, if any (an instance of an earlier version sends
        # none: the core then finds them incomplete and ends the request with an error)
        prompt_logprobs = [wire.sampled_token(t) for t in message.get("prompt_logprobs") or ()]
        with self._lock:
            if self._transfers.pop(request_id, None) is None:
                return   # cancelled meanwhile: the ACK lets the prefill side free its blocks anyway
            transfer.request.prompt_logprobs = prompt_logprobs
            self._arrived.append((transfer.request, token))
            now = time.monotonic()
            self._counters["transfers_done"] += 1
            self._counters["handoff_ms"] += int(1000 * (now - transfer.started))
            self._counters["kv_receive_us"] += int(1e6 * (now - (transfer.first_block or now)))
            self._counters["kv_prompt_tokens"] += transfer.request.num_prompt_tokens
        self._wake_engine()

    def _retry(self, transfer: _Transfer, failure: str) -> None:
        """Give up an attempt that lost a message on the way (the prefill instance is there: it may be
        asked again): tell it to free its blocks, and ask again."""
        self._abort_attempt(transfer, failure)
        self._ask_next(transfer, failure, may_repeat=True)

    def _abort_attempt(self, transfer: _Transfer, reason: str) -> None:
        assert transfer.peer is not None
        self._send(transfer.peer.address, protocol.ABORT, id=transfer.request.request_id, attempt=transfer.attempt,
                   reason=reason)

    def _current(self, request_id: str, attempt: Any) -> _Transfer | None:
        """The open transfer whose current attempt this is (caller holds the lock); None for a late
        message of an earlier attempt, or of one given up with no new instance asked yet."""
        transfer = self._transfers.get(request_id)
        if transfer is None or transfer.peer is None or transfer.attempt != attempt:
            return None
        return transfer

    @staticmethod
    def _from_its_peer(transfer: _Transfer, sender: str) -> bool:
        """Whether ``sender`` is the prefill instance the current attempt of ``transfer`` asked: a
        connector's delivery names its sender by the address that sender's ``start()`` returned,
        which is the address the directory publishes (issue 41 item 17)."""
        assert transfer.peer is not None, "a current attempt has its prefill instance"
        return transfer.peer.address == sender

    def _refuse_sender(self, sender: str, kind: str, transfer: _Transfer) -> None:
        """Count (and log, at most every :data:`REFUSAL_LOG_EVERY_S`) a message about ``transfer`` from
        a sender other than its prefill instance; it changes nothing (caller holds the lock)."""
        self._counters["messages_from_another_peer"] += 1
        now = time.monotonic()
        if now >= self._next_refusal_log:
            self._next_refusal_log = now + REFUSAL_LOG_EVERY_S
            log.warning("a %s about %r came from %r, not from the prefill instance asked (%s); ignored "
                        "(%d so far)", kind, transfer.request.request_id, sender[:200], self._peer_name(transfer),
                        self._counters["messages_from_another_peer"])

    @staticmethod
    def _peer_name(transfer: _Transfer) -> str:
        assert transfer.peer is not None, "a current attempt has its prefill instance"
        return transfer.peer.instance_id

    def _ask_next(self, transfer: _Transfer, failure: str | None, *, may_repeat: bool = False) -> None:
        """Ask the next prefill instance (after ``failure`` of the last one; ``may_repeat``: the ones
        tried may be asked again), or fail the request once every attempt is spent or no usable
        instance came within ``splitwise.peer_wait_s``."""
        request = transfer.request
        exhausted = len(transfer.tried) >= self.settings.max_prefill_attempts
        peer = None if exhausted else self._choose_peer(() if may_repeat else transfer.tried)
        with self._lock:
            if self._transfers.get(request.request_id) is not transfer:
                return   # cancelled meanwhile
            if failure is not None:
                self._counters["prefill_attempts_failed"] += 1
                transfer.last_failure = failure
                log.warning("prefill of %r failed: %s", request.request_id, failure)
            if peer is not None:
                self._place(transfer, peer)
            elif not exhausted and not self._waited_out(transfer, failure):
                transfer.peer = None
                return   # asked again at each heartbeat until a prefill instance is there
            else:
                del self._transfers[request.request_id]
        if peer is None:
            self._fail(transfer, self._failure_reason(transfer, exhausted))
            return
        sent = self._send(peer.address, protocol.PREFILL, id=request.request_id, attempt=transfer.attempt,
                          request=wire.encode_request(request), layout=self.me.layout)
        if not sent:
            self._ask_next(transfer, f"{peer.instance_id} does not take messages")

    @staticmethod
    def _place(transfer: _Transfer, peer: PeerInfo) -> None:
        """Start the next attempt of ``transfer`` with ``peer`` (caller holds the lock)."""
        transfer.unplaced_since = None
        transfer.attempt += 1
        transfer.peer = peer
        transfer.tried.append(peer.instance_id)
        transfer.written.clear()
        transfer.first_block = None
        transfer.heard = time.monotonic()

    def _waited_out(self, transfer: _Transfer, failure: str | None) -> bool:
        """True once ``transfer`` waited ``splitwise.peer_wait_s`` for a prefill instance; the wait
        starts anew after each failed attempt (caller holds the lock)."""
        now = time.monotonic()
        if failure is not None or transfer.unplaced_since is None:
            transfer.unplaced_since = now
        return now - transfer.unplaced_since >= self.settings.peer_wait_s

    def _fail(self, transfer: _Transfer, reason: str) -> None:
        """End a request whose hand-off was given up (already out of ``_transfers``) with ``reason``."""
        with self._lock:
            self._failed.append((transfer.request, FinishReason.ERROR, reason))
            self._counters["transfers_failed"] += 1
        self._wake_engine()

    def _choose_peer(self, tried: Collection[str]) -> PeerInfo | None:
        """The least loaded compatible prefill instance not in ``tried``."""
        loads: dict[str, int] = {}
        with self._lock:
            for open_transfer in self._transfers.values():
                if open_transfer.peer is not None:
                    loads[open_transfer.peer.instance_id] = (loads.get(open_transfer.peer.instance_id, 0)
                                                             + open_transfer.request.num_prompt_tokens)
        candidates = [p for p in self.directory.peers("prefill") if p.instance_id not in tried and self._fits(p)]
        return min(candidates, key=lambda p: (p.load + loads.get(p.instance_id, 0), p.instance_id), default=None)

    def _fits(self, peer: PeerInfo) -> bool:
        return self._mismatch(peer) is None

    def _mismatch(self, peer: PeerInfo) -> str | None:
        """Why ``peer`` cannot compute prompts for this instance, or None."""
        if peer.connector != self.me.connector:
            return f"{peer.instance_id} uses connector {peer.connector!r}, this instance {self.me.connector!r}"
        if peer.layout != self.me.layout:
            return f"{peer.instance_id} has KV layout {peer.layout}, this instance {self.me.layout}"
        if self.connector.same_host_only and peer.host != self.me.host:
            return f"{peer.instance_id} runs on another host, and connector {self.me.connector!r} is same-host only"
        return None

    def start(self, wake_engine: Callable[[], None]) -> None:
        """Join, then say (in the log) why any registered prefill instance cannot pair with this one."""
        super().start(wake_engine)
        for peer in self.directory.peers("prefill"):
            mismatch = self._mismatch(peer)
            if mismatch is not None:
                log.warning("prefill instance %s", mismatch)

    def _failure_reason(self, transfer: _Transfer, exhausted: bool) -> str:
        """Why the request's prompt was computed nowhere: the attempts were spent, or no usable prefill
        instance was there (saying which are registered but cannot pair, and why)."""
        if exhausted:
            return (f"the prompt could not be computed by a prefill instance after {len(transfer.tried)} "
                    f"attempt(s) (splitwise.max_prefill_attempts); last: {transfer.last_failure}")
        waited = f"no prefill instance was available within {self.settings.peer_wait_s} s (splitwise.peer_wait_s)"
        if transfer.last_failure is not None:
            return f"{waited}; last: {transfer.last_failure}"
        where = " on this host" if self.connector.same_host_only else ""
        unfit = [m for m in map(self._mismatch, self.directory.peers("prefill")) if m is not None]
        return (f"{waited}: no live prefill instance with connector {self.me.connector!r} and this KV layout "
                f"is registered{where}; start one with splitwise.role = 'prefill'"
                + (f" (registered but unfit: {'; '.join(unfit)})" if unfit else ""))
