"""The ``zmq`` connector: control and block messages over TCP, block buffers sent without copying.

Each instance binds one ROUTER socket (its address, ``tcp://advertise_host:port``) and keeps one
DEALER per peer it sends to, whose routing id is its own address (so a receiver knows who sent
a message). A message is one multipart zmq message: the msgpack-packed control dict, then a
block's buffers as frames, handed to zmq without copying (zmq reads them from the KV cache while
sending). ``send`` never blocks: a peer whose queue is full (``send_hwm`` messages) makes it
return False. A wake-up frame on an inproc socket makes a blocked ``receive`` return.
"""

from __future__ import annotations

import ipaddress
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import msgpack
import zmq
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from fd_core.contracts.connector import Connector, ConnectorRole, Delivery
from fd_core.hookspecs import FD_HOOKSPEC_VERSION


class ZmqConnectorSettings(BaseModel):
    """``[connector.options]`` of the ``zmq`` connector."""

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", description="Address the connector binds (0.0.0.0: every interface).")
    port: int = Field(0, ge=0, le=65535, description="TCP port it binds; 0 picks a free one.")
    advertise_host: str | None = Field(None, validate_default=True, description=(
        "Address peers reach it at (published in the peer directory); unset: host. Required when host "
        "binds every interface."))
    send_hwm: int = Field(1000, gt=0, description="Messages queued per peer before send reports it full.")

    @field_validator("advertise_host")
    @classmethod
    def _reachable(cls, value: str | None, info: ValidationInfo) -> str | None:
        host = info.data.get("host", "")
        if value is None and _binds_everything(host):
            raise ValueError(f"required when host is {host!r} (peers cannot connect to it); "
                             "set it to this machine's address that peers reach")
        return value

    @property
    def published_host(self) -> str:
        host = self.advertise_host or self.host
        return f"[{host}]" if ":" in host else host


def _binds_everything(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return host == "*"


class ZmqConnector(Connector):
    """Control and block messages over zmq ROUTER/DEALER sockets (TCP)."""

    name: ClassVar[str] = "zmq"
    fd_hookspec_version: ClassVar[int] = FD_HOOKSPEC_VERSION
    settings_model: ClassVar[type[BaseModel]] = ZmqConnectorSettings

    def __init__(self, settings: ZmqConnectorSettings | None, *, role: ConnectorRole, instance_id: str) -> None:
        super().__init__(settings or ZmqConnectorSettings(), role=role, instance_id=instance_id)
        self._context = zmq.Context()
        self._inbox: zmq.Socket[bytes] | None = None
        self._peers: dict[str, zmq.Socket[bytes]] = {}
        self._wake_addr = f"inproc://fd-connector-wake-{id(self)}"
        self._wake_in: zmq.Socket[bytes] | None = None
        self._wake_out: zmq.Socket[bytes] | None = None
        self._wake_lock = threading.Lock()
        self._poller = zmq.Poller()
        self.address = ""
        self._stats = {"messages_sent": 0, "messages_received": 0, "bytes_sent": 0, "bytes_received": 0,
                       "messages_not_taken": 0}

    # --- the contract --------------------------------------------------------------------------

    def start(self) -> str:
        self._inbox = self._context.socket(zmq.ROUTER)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.RCVHWM, 0)
        self.address = self._bind(self._inbox)
        self._wake_in = self._context.socket(zmq.PULL)
        self._wake_in.bind(self._wake_addr)
        self._poller.register(self._inbox, zmq.POLLIN)
        self._poller.register(self._wake_in, zmq.POLLIN)
        return self.address

    def send(self, peer: str, message: dict[str, Any], buffers: Sequence[memoryview] = ()) -> bool:
        socket = self._peers.get(peer) or self._connect(peer)
        header, frames = self._frames(peer, message, buffers)
        try:
            socket.send_multipart([header, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._stats["messages_not_taken"] += 1
            return False
        self._stats["messages_sent"] += 1
        self._stats["bytes_sent"] += len(header) + sum(memoryview(f).nbytes for f in frames)
        return True

    def receive(self, timeout: float) -> Delivery | None:
        assert self._inbox is not None and self._wake_in is not None, "start() first"
        self._released()
        ready = dict(self._poller.poll(max(0, int(timeout * 1000))))
        if self._wake_in in ready:
            while self._wake_in.poll(0):
                self._wake_in.recv()
        if self._inbox not in ready:
            return None
        return self._delivery(*self._read_inbox())

    def wake(self) -> None:
        with self._wake_lock:
            if self._wake_out is None:
                self._wake_out = self._context.socket(zmq.PUSH)
                self._wake_out.setsockopt(zmq.LINGER, 0)
                self._wake_out.setsockopt(zmq.SNDHWM, 1)
                self._wake_out.connect(self._wake_addr)
            try:
                self._wake_out.send(b"", flags=zmq.NOBLOCK)
            except zmq.Again:
                pass   # a wake-up is already pending

    def forget_peer(self, peer: str) -> None:
        socket = self._peers.pop(peer, None)
        if socket is not None:
            socket.close(linger=0)

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    def close(self) -> None:
        for peer in list(self._peers):
            self.forget_peer(peer)
        with self._wake_lock:
            for socket in (self._inbox, self._wake_in, self._wake_out):
                if socket is not None:
                    socket.close(linger=0)
            self._wake_out = None
        self._context.term()

    # --- what the shm connector changes --------------------------------------------------------

    def _bind(self, socket: zmq.Socket[bytes]) -> str:
        settings: ZmqConnectorSettings = self.settings
        socket.setsockopt(zmq.IPV6, int(":" in settings.host))
        if settings.port:
            socket.bind(f"tcp://{_bind_host(settings.host)}:{settings.port}")
            port = settings.port
        else:
            port = socket.bind_to_random_port(f"tcp://{_bind_host(settings.host)}")
        return f"tcp://{settings.published_host}:{port}"

    def _frames(self, peer: str, message: dict[str, Any], buffers: Sequence[memoryview]) -> tuple[bytes, list[Any]]:
        """The header and the frames that carry ``message`` and its ``buffers`` to ``peer``."""
        return msgpack.packb(message, use_bin_type=True), list(buffers)

    def _delivery(self, sender: str, message: dict[str, Any], frames: list[memoryview]) -> Delivery | None:
        """What ``receive`` returns for one message read from the inbox (None: nothing for the caller)."""
        return Delivery(sender, message, frames)

    def _released(self) -> None:
        """The last delivery's buffers may go (the contract keeps them until the next receive)."""

    # --- internals -----------------------------------------------------------------------------

    def _read_inbox(self) -> tuple[str, dict[str, Any], list[memoryview]]:
        """One message from the inbox (it must be readable): sender, control dict, frames."""
        assert self._inbox is not None
        sender, header, *frames = self._inbox.recv_multipart(copy=False)
        self._stats["messages_received"] += 1
        self._stats["bytes_received"] += len(header.bytes) + sum(len(f.buffer) for f in frames)
        return sender.bytes.decode(), msgpack.unpackb(header.bytes, raw=False), [f.buffer for f in frames]

    def _connect(self, peer: str) -> zmq.Socket[bytes]:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, self.settings.send_hwm)
        socket.setsockopt(zmq.ROUTING_ID, self.address.encode())
        socket.connect(peer)
        self._peers[peer] = socket
        return socket


def _bind_host(host: str) -> str:
    if _binds_everything(host):
        return "*"
    return f"[{host}]" if ":" in host else host
