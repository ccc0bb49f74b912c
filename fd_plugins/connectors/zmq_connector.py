"""The ``zmq`` connector: control and block messages over TCP, block buffers sent without copying.

Each instance binds one ROUTER socket (its address, ``tcp://advertise_host:port``) and keeps one
DEALER per peer it sends to, whose routing id is its own address (so a receiver knows who sent
a message). A message is one multipart zmq message: the msgpack-packed control dict, then a
block's buffers as frames, handed to zmq without copying (zmq reads them from the KV cache while
sending). ``send`` never blocks: a peer whose queue is full (``send_hwm`` messages) makes it
return False. A wake-up frame on an inproc socket makes a blocked ``receive`` return.

A DEALER this instance sent nothing through for ``peer_idle_s`` is closed (at the next
``receive``; the next ``send`` to that peer opens a new one), so the connections to peers that
left do not pile up: the hand-off sends ``ALIVE`` every heartbeat to each peer it works with.

With ``curve_secret_key`` set, every connection is authenticated and encrypted with CURVE
(:mod:`fd_plugins.connectors.curve`): a client without a trusted key is refused at the
handshake, a message is taken only from the peer its declared address names, and messages are
sent only to peers whose key is trusted. Without it the connector is plaintext and believes any
sender (keep it on a private network). The inbox keeps at most ``receive_hwm`` messages per
sending peer; a sender whose messages are not read fills up, and its ``send`` reports us full.
A message that does not decode is dropped and counted (``messages_refused``).
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import msgpack
import zmq
from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator

from fd_core.contracts.connector import Connector, ConnectorRole, Delivery
from fd_core.hookspecs import FD_HOOKSPEC_VERSION
from fd_plugins.connectors.curve import Curve, check_key, split_address

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)
#: Seconds between two log lines about refused messages.
REFUSAL_LOG_EVERY_S = 10.0


class PeerQueueSettings(BaseModel):
    """The options of the connectors' control links (zmq, and shm's ipc sockets): how much they queue
    per peer, and when an idle connection closes."""

    model_config = ConfigDict(extra="forbid")

    send_hwm: int = Field(1000, gt=0, description="Messages queued per peer before send reports it full.")
    peer_idle_s: float = Field(60.0, gt=0, description=(
        "The connection to a peer this instance sent nothing to for this long is closed (reopened by the next "
        "send)."))
    receive_hwm: int = Field(10000, gt=0, description=(
        "Messages kept per sending peer until receive reads them; beyond it that peer's sends report this "
        "instance full."))


class ZmqConnectorSettings(PeerQueueSettings):
    """``[connector.options]`` of the ``zmq`` connector."""

    model_config = ConfigDict(extra="forbid", hide_input_in_errors=True)   # errors never show the secret key

    host: str = Field("127.0.0.1", description="Address the connector binds (0.0.0.0: every interface).")
    port: int = Field(0, ge=0, le=65535, description="TCP port it binds; 0 picks a free one.")
    advertise_host: str | None = Field(None, validate_default=True, description=(
        "Address peers reach it at (published in the peer directory); unset: host. Required when host "
        "binds every interface."))
    curve_secret_key: SecretStr | None = Field(None, description=(
        "This instance's CURVE secret key (Z85, 40 characters): connections are authenticated and encrypted. "
        "Unset: plaintext, anyone who reaches the port is believed."))
    curve_peer_keys: list[str] = Field(default_factory=list, description=(
        "Public CURVE keys (Z85) of the peers that may send to this instance and be sent to, besides its own "
        "(instances sharing one key pair need none)."))

    @field_validator("curve_secret_key")
    @classmethod
    def _a_secret_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            if not zmq.has("curve"):
                raise ValueError("this libzmq has no CURVE support (pip install pyzmq: its wheels have it)")
            check_key(value.get_secret_value(), "the value")
        return value

    @field_validator("curve_peer_keys")
    @classmethod
    def _public_keys(cls, value: list[str], info: ValidationInfo) -> list[str]:
        for index, key in enumerate(value):
            check_key(key, f"item {index}")
        if value and info.data.get("curve_secret_key") is None:
            raise ValueError("needs curve_secret_key (this instance's own key pair)")
        return value

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
        self._curve = self._curve_of(self.settings)
        self._authenticator: ThreadAuthenticator | None = None
        self._context = zmq.Context()
        self._inbox: zmq.Socket[bytes] | None = None
        self._peers: dict[str, zmq.Socket[bytes]] = {}
        self._last_sent: dict[str, float] = {}   # peer -> time.monotonic() of its last send
        self._next_idle_check = 0.0
        self._wake_addr = f"inproc://fd-connector-wake-{id(self)}"
        self._wake_in: zmq.Socket[bytes] | None = None
        self._wake_out: zmq.Socket[bytes] | None = None
        self._wake_lock = threading.Lock()
        self._poller = zmq.Poller()
        self.address = ""
        self._stats = {"messages_sent": 0, "messages_received": 0, "bytes_sent": 0, "bytes_received": 0,
                       "messages_not_taken": 0, "peers_closed_idle": 0, "messages_refused": 0, "peers_refused": 0}
        self._next_refusal_log = 0.0
        self._refused_peers: set[str] = set()   # peers not sent to, each logged once

    # --- the contract --------------------------------------------------------------------------

    def start(self) -> str:
        self._inbox = self._context.socket(zmq.ROUTER)
        self._inbox.setsockopt(zmq.LINGER, 0)
        self._inbox.setsockopt(zmq.RCVHWM, self.settings.receive_hwm)
        # a sender that reconnects (after forget_peer) may arrive before its old connection is gone
        # here: its new connection takes over its routing id instead of being ignored
        self._inbox.setsockopt(zmq.ROUTER_HANDOVER, 1)
        if self._curve is not None:
            self._authenticator = self._curve.authenticator(self._context)
            self._curve.serve(self._inbox)
            self.address = self._curve.address(self._bind(self._inbox))
        else:
            self.address = self._bind(self._inbox)
        self._wake_in = self._context.socket(zmq.PULL)
        self._wake_in.bind(self._wake_addr)
        self._poller.register(self._inbox, zmq.POLLIN)
        self._poller.register(self._wake_in, zmq.POLLIN)
        return self.address

    def send(self, peer: str, message: dict[str, Any], buffers: Sequence[memoryview] = ()) -> bool:
        socket = self._peers.get(peer) or self._connect(peer)
        if socket is None:
            self._stats["messages_not_taken"] += 1
            return False
        self._last_sent[peer] = time.monotonic()
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
        self._close_idle_peers()
        ready = dict(self._poller.poll(max(0, int(timeout * 1000))))
        if self._wake_in in ready:
            while self._wake_in.poll(0):
                self._wake_in.recv()
        if self._inbox not in ready:
            return None
        read = self._read_inbox()
        return None if read is None else self._delivery(*read)

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
        self._last_sent.pop(peer, None)
        if socket is not None:
            socket.close(linger=0)

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    def close(self) -> None:
        for socket in self._peers.values():
            socket.close(linger=0)
        self._peers.clear()
        self._last_sent.clear()
        with self._wake_lock:
            for socket in (self._inbox, self._wake_in, self._wake_out):
                if socket is not None:
                    socket.close(linger=0)
            self._wake_out = None
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    # --- what the shm connector changes --------------------------------------------------------

    def _curve_of(self, settings: Any) -> Curve | None:
        """The CURVE keys of ``settings`` (None: plaintext)."""
        return Curve.from_settings(settings.curve_secret_key, settings.curve_peer_keys)

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

    def _may_close(self, peer: str) -> bool:
        """Whether the connection to ``peer``, idle for ``peer_idle_s``, may be closed."""
        return True

    # --- internals -----------------------------------------------------------------------------

    def _read_inbox(self) -> tuple[str, dict[str, Any], list[memoryview]] | None:
        """One message from the inbox (it must be readable): sender, control dict, frames; None: refused."""
        assert self._inbox is not None
        sender_frame, header, *frames = self._inbox.recv_multipart(copy=False)
        self._stats["messages_received"] += 1
        self._stats["bytes_received"] += len(header.bytes) + sum(len(f.buffer) for f in frames)
        if sender_frame.bytes[:1] == b"\0":   # an id zmq made up: a connection superseded by its sender's new one
            return self._refuse(repr(sender_frame.bytes), "it came over a connection its sender replaced")
        sender = sender_frame.bytes.decode(errors="replace")
        if self._curve is not None and not self._curve.sent_by(sender, _authenticated_key(header)):
            return self._refuse(sender, "its address is not the peer its connection authenticated as")
        try:
            message = msgpack.unpackb(header.bytes, raw=False)
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            return self._refuse(sender, f"its header does not decode ({exc})")
        if not isinstance(message, dict) or not isinstance(message.get("kind"), str):
            return self._refuse(sender, "its header is not a dict with a kind")
        return sender, message, [f.buffer for f in frames]

    def _refuse(self, sender: str, why: str) -> None:
        """Drop a message read from the inbox; log it (at most every :data:`REFUSAL_LOG_EVERY_S`)."""
        self._stats["messages_refused"] += 1
        now = time.monotonic()
        if now >= self._next_refusal_log:
            self._next_refusal_log = now + REFUSAL_LOG_EVERY_S
            log.warning("connector: a message from %r refused: %s (%d refused so far)", sender[:200], why,
                        self._stats["messages_refused"])

    def _close_idle_peers(self) -> None:
        """Close the DEALERs of peers sent nothing for ``peer_idle_s`` (checked at most once a second)."""
        now = time.monotonic()
        if now < self._next_idle_check:
            return
        self._next_idle_check = now + min(1.0, self.settings.peer_idle_s)
        idle = [peer for peer, sent in self._last_sent.items() if now - sent > self.settings.peer_idle_s]
        for peer in filter(self._may_close, idle):
            self._peers.pop(peer).close(linger=0)
            del self._last_sent[peer]
            self._stats["peers_closed_idle"] += 1

    def _connect(self, peer: str) -> zmq.Socket[bytes] | None:
        """A DEALER to ``peer``, or None when this instance does not send to it (its key is not trusted)."""
        endpoint, server_key = split_address(peer)
        refusal = self._why_not_send_to(server_key)
        if refusal is not None:
            return self._refuse_peer(peer, refusal)
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SNDHWM, self.settings.send_hwm)
        socket.setsockopt(zmq.ROUTING_ID, self.address.encode())
        if self._curve is not None:
            assert server_key is not None
            self._curve.connect_as_client(socket, server_key)
        try:
            socket.connect(endpoint)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            return self._refuse_peer(peer, f"not an address zmq can connect to ({exc})")
        self._peers[peer] = socket
        return socket

    def _refuse_peer(self, peer: str, why: str) -> None:
        """Count a send not made to ``peer``; say why in the log, once a peer."""
        self._stats["peers_refused"] += 1
        if peer not in self._refused_peers:
            self._refused_peers.add(peer)
            log.warning("connector: nothing is sent to %r: %s", peer[:200], why)

    def _why_not_send_to(self, server_key: bytes | None) -> str | None:
        if self._curve is None:
            return None if server_key is None else (
                "it authenticates with CURVE and this instance has no key (connector.options.curve_secret_key)")
        if server_key is None:
            return "it does not authenticate (no CURVE key in its address; connector.options.curve_secret_key)"
        if server_key not in self._curve.trusted:
            return "its CURVE key is not trusted (connector.options.curve_peer_keys)"
        return None


def _authenticated_key(frame: zmq.Frame) -> str | None:
    """The public key (Z85) the connection ``frame`` came over authenticated with (None: none)."""
    try:
        return frame.get("User-Id")
    except zmq.ZMQError:
        return None


def _bind_host(host: str) -> str:
    if _binds_everything(host):
        return "*"
    return f"[{host}]" if ":" in host else host
