"""The ``shm`` connector: same-host peers; block buffers through shared memory, control over ipc.

Control messages travel as with ``zmq``, over ``ipc://`` sockets instead of TCP. A block's
buffers are copied into a slot of the sender's shared-memory segment (``buffer_mb``, created on
the first block; a slot holds one block of every layer) and the control message names the
segment, the slot, the buffers' sizes and the slot's generation (a number the sender never
gives twice); the receiver maps the segment and reads the buffers in place (the hand-off copies
them into its cache), then, at its next ``receive``, hands the slot back with an internal
``_shm_free`` message. With every slot in use ``send`` waits up to :data:`SLOT_WAIT_S` for one to
come back (keeping what else arrives meanwhile for ``receive``), then reports the peer full.

A slot is written again only once its receiver handed it back, or its receiver's process is
gone (the pid is part of every address). ``forget_peer`` therefore does not take back the slots
the forgotten peer holds: their notices may still be in that peer's inbox. It asks the peer
(``_shm_revoke``) to give them up; the peer answers with ``_shm_free`` and from then on refuses a
notice of those generations, so a notice read late never shows another transfer's bytes.

A receiver unmaps a sender's segment when it forgets the sender or finds its process gone
(checked at most every :data:`SWEEP_S` in ``receive``). The segments are unlinked when their
owner exits (even by kill -9: Python's resource tracker does it).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any, ClassVar, Final

from pydantic import BaseModel, ConfigDict, Field

from fd_core.contracts.connector import ConnectorRole, Delivery
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_plugins.connectors.zmq_connector import PeerQueueSettings, ZmqConnector

#: Longest wait of a send for a free slot, in seconds.
SLOT_WAIT_S: Final = 1.0
#: How often ``receive`` looks for senders whose process is gone, in seconds.
SWEEP_S: Final = 1.0
#: The internal message that hands slots back to their owner: ``slots`` = [[slot, generation], ...].
_FREE: Final = "_shm_free"
#: The internal message that asks a forgotten peer to give slots up: ``segment``, ``slots``.
_REVOKE: Final = "_shm_revoke"


class ShmConnectorSettings(PeerQueueSettings):
    """``[connector.options]`` of the ``shm`` connector."""

    model_config = ConfigDict(extra="forbid")

    buffer_mb: int = Field(256, gt=0, description=(
        "Shared memory this instance sends blocks through (MiB); blocks in flight beyond it wait."))
    socket_dir: str | None = Field(None, description="Folder of the ipc control sockets; unset: the temp folder.")


@dataclass(slots=True)
class _Mapped:
    """A peer's segment this instance reads from."""

    sender: str               # the address of the segment's owner
    memory: SharedMemory | None   # None: unmapped (the sender was forgotten; mapped again on its next block)


class ShmConnector(ZmqConnector):
    """Block buffers through a shared-memory segment; control messages over zmq ipc sockets."""

    name: ClassVar[str] = "shm"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    settings_model: ClassVar[type[BaseModel]] = ShmConnectorSettings
    same_host_only: ClassVar[bool] = True

    def __init__(self, settings: ShmConnectorSettings | None, *, role: ConnectorRole, instance_id: str) -> None:
        super().__init__(settings or ShmConnectorSettings(), role=role, instance_id=instance_id)
        # sending
        self._segment: SharedMemory | None = None      # ours, created on the first block sent
        self._slot_bytes = 0
        self._free_slots: deque[int] = deque()
        self._slot_holder: dict[int, tuple[str, int]] = {}   # slot -> (the peer reading it, generation)
        self._generations = count(1)
        self._kept: deque[tuple[str, dict[str, Any], list[memoryview]]] = deque()   # read while waiting
        # receiving
        self._mapped: dict[str, _Mapped] = {}             # peers' segments, by name
        self._seen_up_to: dict[tuple[str, int], int] = {}   # (segment, slot) -> newest generation seen
        self._to_release: list[tuple[str, int, int]] = []   # (sender, slot, generation) of the last delivery
        self._next_sweep = 0.0
        self._stats.update(slots_waited=0, blocks_refused_stale=0, segments_unmapped=0)

    def receive(self, timeout: float) -> Delivery | None:
        self._unmap_dead_senders()
        if self._kept:
            self._released()
            return self._delivery(*self._kept.popleft())
        return super().receive(timeout)

    def forget_peer(self, peer: str) -> None:
        super().forget_peer(peer)
        self._unmap(peer)
        held = self._held_by(peer)
        if not held:
            return
        if _process_alive(peer):   # its inbox may still hold their notices: it gives them up itself
            assert self._segment is not None
            super().send(peer, {"kind": _REVOKE, "segment": self._segment.name, "slots": held})
        else:
            self._take_back(peer, held)

    def close(self) -> None:
        self._to_release.clear()
        for sender in {mapped.sender for mapped in self._mapped.values()}:
            self._unmap(sender)
        if self._segment is not None:
            with contextlib.suppress(BufferError):
                self._segment.close()
            self._segment.unlink()
        super().close()

    # --- the zmq connector's hooks ---------------------------------------------------------------

    def _curve_of(self, settings: Any) -> None:
        return None   # same host: the ipc sockets are guarded by socket_dir's permissions

    def _bind(self, socket: Any) -> str:
        folder = self.settings.socket_dir or tempfile.gettempdir()
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", self.instance_id)
        address = f"ipc://{os.path.join(folder, f'fd-shm-{safe}.{os.getpid()}.sock')}"
        socket.bind(address)
        return address

    def _frames(self, peer: str, message: dict[str, Any], buffers: Sequence[memoryview]) -> tuple[bytes, list[Any]]:
        if not buffers:
            return super()._frames(peer, message, buffers)
        slot = self._take_slot(sum(b.nbytes for b in buffers))
        if slot is None:
            raise _NoSlot
        assert self._segment is not None
        offset, sizes = slot * self._slot_bytes, []
        for buffer in buffers:
            self._segment.buf[offset:offset + buffer.nbytes] = buffer
            offset += buffer.nbytes
            sizes.append(buffer.nbytes)
        generation = next(self._generations)
        self._slot_holder[slot] = (peer, generation)
        return super()._frames(peer, {**message, "_shm": [self._segment.name, slot, sizes, generation]}, ())

    def send(self, peer: str, message: dict[str, Any], buffers: Sequence[memoryview] = ()) -> bool:
        try:
            return super().send(peer, message, buffers)
        except _NoSlot:
            self._stats["messages_not_taken"] += 1
            return False

    def _delivery(self, sender: str, message: dict[str, Any], frames: list[memoryview]) -> Delivery | None:
        kind = message.get("kind")
        if kind == _FREE:
            self._take_back(sender, message["slots"])
            return None
        if kind == _REVOKE:
            self._give_up(sender, message["segment"], message["slots"])
            return None
        placed = message.pop("_shm", None)
        if placed is None:
            return Delivery(sender, message, frames)
        return self._block_delivery(sender, message, *placed)

    def _released(self) -> None:
        for sender, slot, generation in self._to_release:
            super().send(sender, {"kind": _FREE, "slots": [[slot, generation]]})
        self._to_release.clear()

    def _may_close(self, peer: str) -> bool:
        """Not while a live ``peer`` holds slots: closing would drop their notices, and the slots with them."""
        if not _process_alive(peer):
            self._take_back(peer, self._held_by(peer))
            return True
        return not self._held_by(peer)

    # --- sending -------------------------------------------------------------------------------

    def _held_by(self, peer: str) -> list[list[int]]:
        """The slots ``peer`` holds, as [slot, generation] pairs."""
        return [[slot, generation] for slot, (holder, generation) in self._slot_holder.items() if holder == peer]

    def _take_slot(self, size: int) -> int | None:
        if self._segment is None:
            self._create_segment(size)
        if size != self._slot_bytes:
            raise ValueError(f"blocks of {size} bytes do not fit slots of {self._slot_bytes}")
        if not self._free_slots:
            self._stats["slots_waited"] += 1
            self._take_back_from_dead_holders()
        deadline = time.monotonic() + SLOT_WAIT_S
        while not self._free_slots:
            left = deadline - time.monotonic()
            if left <= 0 or self._inbox is None or not self._inbox.poll(int(left * 1000)):
                return None
            read = self._read_inbox()
            if read is None:
                continue
            sender, message, frames = read
            if message.get("kind") == _FREE:
                self._delivery(sender, message, frames)
            else:
                self._kept.append((sender, message, frames))
        return self._free_slots.popleft()

    def _take_back(self, holder: str, slots: list[list[int]]) -> None:
        """Slots ``holder`` handed back (or cannot read any more); one of a later generation stays held."""
        for slot, generation in slots:
            if self._slot_holder.get(slot) == (holder, generation):
                del self._slot_holder[slot]
                self._free_slots.append(slot)

    def _take_back_from_dead_holders(self) -> None:
        for holder in {holder for holder, _ in self._slot_holder.values()}:
            if not _process_alive(holder):
                self._take_back(holder, self._held_by(holder))

    def _create_segment(self, slot_bytes: int) -> None:
        total = self.settings.buffer_mb << 20
        if slot_bytes > total:
            raise ValueError(f"connector.options.buffer_mb ({self.settings.buffer_mb}) cannot hold one block of "
                             f"{slot_bytes} bytes")
        self._segment = SharedMemory(create=True, size=total - total % slot_bytes)
        self._slot_bytes = slot_bytes
        self._free_slots.extend(range(total // slot_bytes))

    # --- receiving -----------------------------------------------------------------------------

    def _block_delivery(self, sender: str, message: dict[str, Any], segment: str, slot: int, sizes: list[int],
                        generation: int) -> Delivery | None:
        """The block a notice names, or None for a notice of a generation given up (its slot is not ours)."""
        if generation <= self._seen_up_to.get((segment, slot), 0):
            self._stats["blocks_refused_stale"] += 1
            return None
        self._seen_up_to[(segment, slot)] = generation
        view = self._map(sender, segment).buf
        offset = slot * sum(sizes)
        buffers = []
        for size in sizes:
            buffers.append(view[offset:offset + size])
            offset += size
        self._to_release.append((sender, slot, generation))
        return Delivery(sender, message, buffers)

    def _give_up(self, sender: str, segment: str, slots: list[list[int]]) -> None:
        """A sender that forgot us asks for its slots: refuse their notices from now on, hand them back."""
        for slot, generation in slots:
            key = (segment, slot)
            self._seen_up_to[key] = max(self._seen_up_to.get(key, 0), generation)
        super().send(sender, {"kind": _FREE, "slots": slots})

    def _map(self, sender: str, name: str) -> SharedMemory:
        mapped = self._mapped.get(name)
        if mapped is None or mapped.memory is None:
            memory = SharedMemory(name=name)
            # attaching registers it with this process' resource tracker, which would unlink the
            # owner's segment when this process exits (Python < 3.13 has no track=False)
            resource_tracker.unregister(memory._name, "shared_memory")  # type: ignore[attr-defined]
            mapped = self._mapped[name] = _Mapped(sender, memory)
        return mapped.memory

    def _unmap(self, sender: str) -> None:
        """Unmap ``sender``'s segments (one whose buffers are still in use stays until the next try)."""
        for mapped in self._mapped.values():
            if mapped.sender == sender and mapped.memory is not None:
                try:
                    mapped.memory.close()
                except BufferError:
                    continue
                mapped.memory = None
                self._stats["segments_unmapped"] += 1

    def _unmap_dead_senders(self) -> None:
        """Unmap the segments of senders whose process is gone, and forget their generations."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + SWEEP_S
        for sender in {mapped.sender for mapped in self._mapped.values()}:
            if _process_alive(sender):
                continue
            self._unmap(sender)
            for name in [name for name, mapped in self._mapped.items()
                         if mapped.sender == sender and mapped.memory is None]:
                del self._mapped[name]
                self._seen_up_to = {key: g for key, g in self._seen_up_to.items() if key[0] != name}


def _process_alive(address: str) -> bool:
    """Whether the process behind a shm ``address`` runs (True when the address names no pid).

    A zombie (dead, not yet reaped by its parent) counts as gone where ``/proc`` tells; a pid
    another process took over counts as alive (what waits for the dead one then waits on).
    """
    match = re.search(r"\.(\d+)\.sock$", address)
    if match is None:
        return True
    pid = int(match.group(1))
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
                return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")
        except FileNotFoundError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass   # another user's process
    return True


class _NoSlot(Exception):
    """Every slot of the segment is in use (internal: ``send`` returns False)."""
