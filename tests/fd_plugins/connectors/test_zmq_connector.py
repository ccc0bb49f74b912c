"""The zmq connector on real sockets: connections to peers that left are closed; with CURVE keys
only trusted peers get in, a sender cannot declare another's address; the inbox is bounded."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator

import msgpack
import pytest
import zmq
from pydantic import ValidationError
from zmq.utils.monitor import recv_monitor_message

from fd_core.contracts.connector import Delivery
from fd_plugins.connectors.curve import split_address
from fd_plugins.connectors.zmq_connector import ZmqConnector, ZmqConnectorSettings
from tests.conftest import run_fd_serve


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _connector(**options: object) -> ZmqConnector:
    connector = ZmqConnector(ZmqConnectorSettings(**options), role="prefill", instance_id="here")
    connector.start()
    return connector


@pytest.fixture
def here() -> Iterator[ZmqConnector]:
    connector = _connector(peer_idle_s=0.5)
    yield connector
    connector.close()


def _a_peer_comes_and_goes(here: ZmqConnector) -> None:
    """A peer that asks ``here`` something, gets its answer and leaves without a word."""
    peer = _connector()
    try:
        assert peer.send(here.address, {"kind": "prefill", "id": "r"})
        asked = here.receive(10)
        assert asked is not None and asked.sender == peer.address
        assert here.send(peer.address, {"kind": "done", "id": "r"})
        answered = peer.receive(10)
        assert answered is not None and answered.message == {"kind": "done", "id": "r"}
    finally:
        peer.close()


def test_connections_to_peers_that_left_are_closed_and_fds_do_not_grow(here):
    baseline = _open_fds()
    for _ in range(3):
        for _ in range(10):
            _a_peer_comes_and_goes(here)
        grown = _open_fds() - baseline
        assert grown >= 10   # one DEALER (and its descriptors) per peer that came, until it is idle
        deadline = time.monotonic() + 15
        while _open_fds() > baseline:
            assert time.monotonic() < deadline, f"{_open_fds() - baseline} descriptors more than before the peers"
            here.receive(0.2)
    assert here.stats()["peers_closed_idle"] == 30


def test_a_peer_sent_to_again_after_its_connection_was_closed_gets_the_message(here):
    peer = _connector()
    try:
        assert here.send(peer.address, {"kind": "alive", "n": 1})
        assert peer.receive(10).message == {"kind": "alive", "n": 1}
        deadline = time.monotonic() + 15
        while here.stats()["peers_closed_idle"] == 0:
            assert time.monotonic() < deadline
            here.receive(0.2)
        assert here.send(peer.address, {"kind": "alive", "n": 2})
        assert peer.receive(10).message == {"kind": "alive", "n": 2}
    finally:
        peer.close()


# --- CURVE authentication, sender checks, bounded inbox (issue 41 item 17) ----------------------


def _keys() -> tuple[str, str]:
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def _curve_connector(secret: str, *, peers: tuple[str, ...] = (), **options: object) -> ZmqConnector:
    return _connector(curve_secret_key=secret, curve_peer_keys=list(peers), **options)


def _raw_dealer(context: zmq.Context, address: str, routing_id: str, keys: tuple[str, str] | None = None
                ) -> zmq.Socket:
    """A DEALER written by hand: it declares ``routing_id`` and, given ``keys``, does CURVE with them."""
    endpoint, server_key = split_address(address)
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.ROUTING_ID, routing_id.encode())
    if keys is not None:
        socket.curve_publickey, socket.curve_secretkey = keys[0].encode(), keys[1].encode()
        socket.curve_serverkey = server_key
    socket.get_monitor_socket()   # before connecting: it sees the handshake
    socket.connect(endpoint)
    return socket


def _wait_for_refused_handshake(socket: zmq.Socket) -> None:
    """Until the server refused ``socket``'s handshake (its monitor says so)."""
    failures = {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}
    monitor = socket.get_monitor_socket()
    deadline = time.monotonic() + 10
    while True:
        assert monitor.poll(max(1, int(1000 * (deadline - time.monotonic())))), "no handshake failure seen"
        event = recv_monitor_message(monitor)["event"]
        assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED, "the server let a client without the key in"
        if event in failures:
            return


def _deliveries_until(connector: ZmqConnector, done: Callable[[list[Delivery]], bool]) -> list[Delivery]:
    """What ``connector`` receives until ``done`` says so (at most 10 s)."""
    received: list[Delivery] = []
    deadline = time.monotonic() + 10
    while not done(received):
        assert time.monotonic() < deadline, (received, connector.stats())
        delivery = connector.receive(0.2)
        if delivery is not None:
            received.append(delivery)
    return received


def _marker_arrived(received: list[Delivery]) -> bool:
    return bool(received) and received[-1].message == {"kind": "marker"}


def test_a_client_without_the_key_is_refused_and_its_messages_have_no_effect():
    public, secret = _keys()
    here, friend = _curve_connector(secret), _curve_connector(secret)
    context = zmq.Context()
    try:
        intruders = [_raw_dealer(context, here.address, friend.address),                 # plaintext
                     _raw_dealer(context, here.address, friend.address, keys=_keys())]   # an unknown key
        for socket in intruders:
            socket.send(msgpack.packb({"kind": "prefill", "id": "forged"}))
        for socket in intruders:
            _wait_for_refused_handshake(socket)
        assert friend.send(here.address, {"kind": "marker"})
        received = _deliveries_until(here, _marker_arrived)
        assert [(d.sender, d.message) for d in received] == [(friend.address, {"kind": "marker"})]
        assert here.stats()["messages_received"] == 1
    finally:
        context.destroy(linger=0)
        friend.close()
        here.close()


def test_a_sender_declaring_another_peers_address_is_refused():
    (b_public, b_secret), (c_public, c_secret), (h_public, h_secret) = _keys(), _keys(), _keys()
    here = _curve_connector(h_secret, peers=(b_public, c_public))
    b = _curve_connector(b_secret, peers=(h_public,))
    c = _curve_connector(c_secret, peers=(h_public,))
    context = zmq.Context()
    try:
        # b holds a trusted key, but declares c's address, or a third host's, as where answers go
        forgers = [_raw_dealer(context, here.address, forged, keys=(b_public, b_secret))
                   for forged in (c.address, "tcp://192.0.2.7:5555", f"tcp://192.0.2.7:5555;curve={'0' * 64}")]
        for socket in forgers:
            socket.send(msgpack.packb({"kind": "prefill", "id": "r"}))
        assert b.send(here.address, {"kind": "marker"})
        received = _deliveries_until(here, lambda got: _marker_arrived(got)
                                     and here.stats()["messages_refused"] == len(forgers))
        assert [(d.sender, d.message) for d in received] == [(b.address, {"kind": "marker"})]
        assert c.receive(0.2) is None and here.stats()["messages_sent"] == 0   # nothing went anywhere
    finally:
        context.destroy(linger=0)
        for connector in (b, c, here):
            connector.close()


def test_nothing_is_sent_to_a_peer_whose_key_is_not_trusted_or_that_has_none():
    _, secret = _keys()
    here = _curve_connector(secret)
    stranger = _curve_connector(_keys()[1])
    plaintext = _connector()
    try:
        for peer in (stranger.address, plaintext.address):
            assert not here.send(peer, {"kind": "block", "id": "r"}, [memoryview(b"kv")])
        assert not plaintext.send(here.address, {"kind": "prefill", "id": "r"})   # no key: cannot reach it
        assert here.stats()["peers_refused"] == 2
        assert stranger.receive(0.2) is None
    finally:
        for connector in (here, stranger, plaintext):
            connector.close()


def test_a_message_that_does_not_decode_is_refused_and_the_connector_goes_on():
    here = _connector()
    context = zmq.Context()
    try:
        socket = _raw_dealer(context, here.address, "tcp://127.0.0.1:9")
        for junk in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"no": "kind"})):
            socket.send(junk)
        deadline = time.monotonic() + 10
        while here.stats()["messages_refused"] < 3:
            assert time.monotonic() < deadline, here.stats()
            assert here.receive(0.2) is None
    finally:
        context.destroy(linger=0)
        here.close()


def test_a_flood_fills_the_bounded_inbox_and_then_the_sender_is_told_it_is_full():
    here = _connector(receive_hwm=50)
    flooder = _connector(send_hwm=50)
    payload = [memoryview(bytes(16 << 10))]
    try:
        taken, refused_since = 0, time.monotonic()
        while taken < 5000 and time.monotonic() - refused_since < 1.0:   # a flood: sends refused 1 s on end
            if flooder.send(here.address, {"kind": "block", "n": taken}, payload):
                taken += 1
                refused_since = time.monotonic()
            else:
                time.sleep(0.005)   # a flooder's retry pace, not a wait for an event
        # the inbox keeps 50, the flooder's queue 50, the kernel's socket buffers the rest (some MB)
        assert taken < 2000, f"{taken} messages of 16 KiB taken while nobody read them"
        received = 0
        while here.receive(2.0) is not None:
            received += 1
        assert received == taken   # what it took arrives, in order
        assert flooder.send(here.address, {"kind": "block", "n": taken}, payload)   # room again
    finally:
        flooder.close()
        here.close()


def test_the_secret_key_is_never_shown():
    public, secret = _keys()
    settings = ZmqConnectorSettings(curve_secret_key=secret, curve_peer_keys=[public])
    assert secret not in repr(settings) and secret not in json.dumps(settings.model_dump(mode="json"))
    with pytest.raises(ValidationError) as refused:
        ZmqConnectorSettings(curve_secret_key=secret[:-1] + "~")
    assert "curve_secret_key" in str(refused.value) and secret[:-1] not in str(refused.value)
    with pytest.raises(ValidationError, match="needs curve_secret_key"):
        ZmqConnectorSettings(curve_peer_keys=[public])


def test_fd_serve_check_masks_the_secret_key_and_its_errors_name_the_key_not_the_value(tmp_path):
    config = tmp_path / "decode.toml"
    config.write_text('[splitwise]\nrole = "decode"\n[scheduler]\nname = "splitwise"\n'
                      'options = {url = "redis://127.0.0.1:1"}\n[connector]\nname = "zmq"\n')
    _, secret = _keys()
    checked = run_fd_serve("--config", str(config), "--check", env={"FD_CONNECTOR__OPTIONS__CURVE_SECRET_KEY": secret})
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout)["connector"]["options"]["curve_secret_key"] == "**********"
    assert secret not in checked.stdout + checked.stderr
    mistyped = secret[:-1] + "~"
    refused = run_fd_serve("--config", str(config), "--check",
                           env={"FD_CONNECTOR__OPTIONS__CURVE_SECRET_KEY": mistyped})
    assert refused.returncode != 0
    assert "connector.options.curve_secret_key: the value is not a Z85 CURVE key" in refused.stderr
    assert mistyped[:-1] not in refused.stdout + refused.stderr
