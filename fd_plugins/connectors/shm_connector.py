"""The ``shm`` connector: same-host peers; block buffers through shared memory, control over ipc.

Control messages travel as with ``zmq``, over ``ipc://`` sockets instead of TCP. A block's
buffers are copied into a slot of the sender's shared-memory segment (``buffer_mb``, created on
the first block; a slot holds one block of every layer) and the control message names the
segment, the slot and the buffers' sizes; the receiver maps the segment once and reads the
buffers in place (the hand-off copies them into its cache), then, at its next ``receive``, hands
the slot back with an internal ``_shm_free`` message. With every slot in use ``send`` waits up to
:data:`SLOT_WAIT_S` for one to come back (keeping what else arrives meanwhile for ``receive``),
then reports the peer full. The segments are unlinked when their owner exits (even by kill -9:
Python's resource tracker does it).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any, ClassVar, Final

from pydantic import BaseModel, ConfigDict, Field

from fd_core.contracts.connector import ConnectorRole, Delivery
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_plugins.connectors.zmq_connector import ZmqConnector

#: Longest wait of a send for a free slot, in seconds.
SLOT_WAIT_S: Final = 1.0
#: The internal message that hands a slot back to its owner.
_FREE: Final = "_shm_free"


class ShmConnectorSettings(BaseModel):
    """``[connector.options]`` of the ``shm`` connector."""

    model_config = ConfigDict(extra="forbid")

    buffer_mb: int = Field(256, gt=0, description=(
        "Shared memory this instance sends blocks through (MiB); blocks in flight beyond it wait."))
    socket_dir: str | None = Field(None, description="Folder of the ipc control sockets; unset: the temp folder.")
    send_hwm: int = Field(1000, gt=0, description="Control messages queued per peer before send reports it full.")


class ShmConnector(ZmqConnector):
    """Block buffers through a shared-memory segment; control messages over zmq ipc sockets."""

    name: ClassVar[str] = "shm"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    settings_model: ClassVar[type[BaseModel]] = ShmConnectorSettings
    same_host_only: ClassVar[bool] = True

    def __init__(self, settings: ShmConnectorSettings | None, *, role: ConnectorRole, instance_id: str) -> None:
        super().__init__(settings or ShmConnectorSettings(), role=role, instance_id=instance_id)
        self._segment: SharedMemory | None = None      # ours, created on the first block sent
        self._slot_bytes = 0
        self._free_slots: deque[int] = deque()
        self._slot_holder: dict[int, str] = {}         # slot -> the peer reading it
        self._attached: dict[str, SharedMemory] = {}   # peers' segments, by name
        self._to_release: list[tuple[str, int]] = []   # (sender, slot) of the last delivery
        self._kept: deque[tuple[str, dict[str, Any], list[memoryview]]] = deque()   # read while waiting
        self._stats.update(slots_waited=0)

    def receive(self, timeout: float) -> Delivery | None:
        if self._kept:
            self._released()
            return self._delivery(*self._kept.popleft())
        return super().receive(timeout)

    def forget_peer(self, peer: str) -> None:
        super().forget_peer(peer)
        for slot, holder in list(self._slot_holder.items()):
            if holder == peer:   # it will never hand them back
                del self._slot_holder[slot]
                self._free_slots.append(slot)

    def close(self) -> None:
        self._to_release.clear()
        for segment in self._attached.values():
            with contextlib.suppress(BufferError):
                segment.close()
        if self._segment is not None:
            with contextlib.suppress(BufferError):
                self._segment.close()
            self._segment.unlink()
        super().close()

    # --- the zmq connector's hooks ---------------------------------------------------------------

    def _bind(self, socket: Any) -> str:
        folder = self.settings.socket_dir or tempfile.gettempdir()
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", self.instance_id)
        address = f"ipc://{os.path.join(folder, f'fd-shm-{safe}.sock')}"
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
        self._slot_holder[slot] = peer
        return super()._frames(peer, {**message, "_shm": [self._segment.name, slot, sizes]}, ())

    def send(self, peer: str, message: dict[str, Any], buffers: Sequence[memoryview] = ()) -> bool:
        try:
            return super().send(peer, message, buffers)
        except _NoSlot:
            self._stats["messages_not_taken"] += 1
            return False

    def _delivery(self, sender: str, message: dict[str, Any], frames: list[memoryview]) -> Delivery | None:
        if message.get("kind") == _FREE:
            self._slot_holder.pop(message["slot"], None)
            self._free_slots.append(message["slot"])
            return None
        placed = message.pop("_shm", None)
        if placed is None:
            return Delivery(sender, message, frames)
        name, slot, sizes = placed
        view = self._attach(name).buf
        offset = slot * sum(sizes)
        buffers = []
        for size in sizes:
            buffers.append(view[offset:offset + size])
            offset += size
        self._to_release.append((sender, slot))
        return Delivery(sender, message, buffers)

    def _released(self) -> None:
        for sender, slot in self._to_release:
            super().send(sender, {"kind": _FREE, "slot": slot})
        self._to_release.clear()

    # --- internals -----------------------------------------------------------------------------

    def _take_slot(self, size: int) -> int | None:
        if self._segment is None:
            self._create_segment(size)
        if size != self._slot_bytes:
            raise ValueError(f"blocks of {size} bytes do not fit slots of {self._slot_bytes}")
        deadline = time.monotonic() + SLOT_WAIT_S
        if not self._free_slots:
            self._stats["slots_waited"] += 1
        while not self._free_slots:
            left = deadline - time.monotonic()
            if left <= 0 or self._inbox is None or not self._inbox.poll(int(left * 1000)):
                return None
            sender, message, frames = self._read_inbox()
            if self._delivery_if_free(sender, message, frames):
                continue
        return self._free_slots.popleft()

    def _delivery_if_free(self, sender: str, message: dict[str, Any], frames: list[memoryview]) -> bool:
        """Take a slot handed back; keep anything else for ``receive``. True when it was a slot."""
        if message.get("kind") == _FREE:
            self._delivery(sender, message, frames)
            return True
        self._kept.append((sender, message, frames))
        return False

    def _create_segment(self, slot_bytes: int) -> None:
        total = self.settings.buffer_mb << 20
        if slot_bytes > total:
            raise ValueError(f"connector.options.buffer_mb ({self.settings.buffer_mb}) cannot hold one block of "
                             f"{slot_bytes} bytes")
        self._segment = SharedMemory(create=True, size=total - total % slot_bytes)
        self._slot_bytes = slot_bytes
        self._free_slots.extend(range(total // slot_bytes))

    def _attach(self, name: str) -> SharedMemory:
        segment = self._attached.get(name)
        if segment is None:
            segment = self._attached[name] = SharedMemory(name=name)
            # attaching registers it with this process' resource tracker, which would unlink the
            # owner's segment when this process exits (Python < 3.13 has no track=False)
            resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
        return segment


class _NoSlot(Exception):
    """Every slot of the segment is in use (internal: ``send`` returns False)."""
