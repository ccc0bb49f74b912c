"""Contract of the Connector seam: the transport between prefill and decode instances.

In a prefill/decode (splitwise) deployment a decode instance takes each request, reserves the
request's KV blocks first, then asks a prefill instance to compute the prompt; the prefill
instance ships the KV block by block and then the first token, and frees its blocks once the
decode instance confirmed. That protocol (its messages, heartbeats, timeouts, retries and who
frees what when) lives in the core, :mod:`fd_core.splitwise`, identical for every connector. A
connector only *moves* messages between instances, addressed by the string each instance
publishes (:meth:`Connector.start`):

* a **control message** is a small dict of primitives (``kind``, request id, ...);
* a **block message** is a control message plus ``buffers``: the K and V of one KV block, one
  buffer per layer and tensor, which the receiver copies into its own cache.

Threads: :meth:`start`, :meth:`send`, :meth:`receive`, :meth:`forget_peer` and :meth:`close` are
called from one thread (the core's hand-off thread); :meth:`wake` from any thread.

Invariants every connector keeps (a full hand-off over each built-in is tested on loopback):

- Between one sender and one receiver, messages arrive in the order sent, each at most once; a
  message may be lost only when a peer dies or cannot take it (the protocol's timeouts cover that).
- :meth:`send` never blocks for long: a peer that does not take messages makes it return False.
- The sender keeps the memory behind ``buffers`` unchanged until the receiver confirmed the
  hand-off or the hand-off was given up; a connector may send from it without copying.
- A :class:`Delivery`'s ``buffers`` stay valid until the next :meth:`receive` call.

Changed in hookspec version 3: version 1's ``send(KVTransfer)`` / ``receive()`` pair shipped a
whole request's KV as one object and had no way to preallocate, abort or confirm.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from fd_core.contracts._base import SeamPlugin

if TYPE_CHECKING:
    from pydantic import BaseModel

#: The role a connector serves in; a mixed instance has no connector.
ConnectorRole = Literal["prefill", "decode"]


@dataclass(slots=True)
class Delivery:
    """One received message: who sent it, its control fields, and a block's buffers (if any)."""

    sender: str                      # the sender's address, as its start() returned it (the hand-off takes
    #                                  a transfer's messages only from the address it asked)
    message: dict[str, Any]
    buffers: list[memoryview] = field(default_factory=list)


class Connector(SeamPlugin, ABC):
    """Moves control and block messages between prefill and decode instances."""

    #: True when peers must run on the same host as this instance (shared memory).
    same_host_only: bool = False

    def __init__(self, settings: BaseModel | None, *, role: ConnectorRole, instance_id: str) -> None:
        self.settings = settings
        self.role = role
        self.instance_id = instance_id

    @abstractmethod
    def start(self) -> str:
        """Bind what peers send to; return this instance's address (published to the peers)."""

    @abstractmethod
    def send(self, peer: str, message: dict[str, Any], buffers: Sequence[memoryview] = ()) -> bool:
        """Queue ``message`` (and a block's ``buffers``) for ``peer``; False when it cannot take it."""

    @abstractmethod
    def receive(self, timeout: float) -> Delivery | None:
        """The next message for this instance, or None after ``timeout`` seconds or a :meth:`wake`."""

    @abstractmethod
    def wake(self) -> None:
        """Make a blocked :meth:`receive` return None soon; safe from any thread."""

    def forget_peer(self, peer: str) -> None:
        """Drop what is kept for a peer that is gone (connections, buffers); a later send reconnects."""

    def stats(self) -> dict[str, int]:
        """Counters for /metrics, e.g. ``bytes_sent``, ``bytes_received``, ``messages_dropped``."""
        return {}

    def close(self) -> None:
        """Release sockets or shared memory; called once at shutdown."""
