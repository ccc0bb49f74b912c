"""Conformance kit for Connector plugins: the transport on loopback, then a real prefill -> decode hand-off.

Use it from a plugin's own pytest, no device needed (the hand-off runs two tiny CPU engines)::

    from fd_core.testing.conformance import check_connector

    def test_my_connector_conforms():
        check_connector(MyConnector)                              # settings from settings_model
        check_connector(MyConnector, options={"port": 0})
        check_connector(lambda settings, role, instance_id: MyConnector(
            settings, role=role, instance_id=instance_id), skip={"handoff", "handoff_abort"})

The transport checks drive two instances (roles prefill and decode) started side by side; the
hand-off checks (:mod:`.handoff`) build a mixed, a prefill and a decode engine around the
connector under test. See :data:`CONNECTOR_CHECKS` for the invariants.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

from fd_core.testing.conformance._factories import ThreadCall, describe, plugin_settings
from fd_core.testing.conformance._report import Check, SeamReport, broken, run_checks
from fd_core.testing.conformance.handoff import HANDOFF_CHECKS, HandoffRig

if TYPE_CHECKING:
    from fd_core.contracts.connector import Connector, ConnectorRole, Delivery

__all__ = ["CONNECTOR_CHECKS", "ConnectorFactory", "check_connector", "run_connector_checks"]

SEAM: Final = "connector"
#: ``factory(settings, role, instance_id)``: a new connector, as the contract's constructor.
ConnectorFactory = Callable[[Any, "ConnectorRole", str], "Connector"]
#: Longest wait for a message on loopback.
PATIENCE_S: Final = 5.0
#: Longest a send may take, even to a peer that is gone.
SEND_LIMIT_S: Final = 2.0

ADDRESSES: Final = "start() gives each instance its own address"
ORDER: Final = "control messages arrive in order, once each, from their sender"
BUFFERS: Final = "block buffers arrive byte-identical and stay valid until the next receive"
WAKE: Final = "wake() makes a blocked receive return early"
TIMEOUT: Final = "receive returns None after its timeout when nothing arrives"
UNKNOWN_PEER: Final = "send to an unreachable peer does not block for long"
CLOSE: Final = "close releases the connector"


def check_connector(plugin: type[Connector] | ConnectorFactory, *, options: Mapping[str, Any] | None = None,
                    settings: Any = None, skip: Collection[str] = (), model_dir: str | None = None) -> SeamReport:
    """Run every connector check; return the report, or raise ConformanceError naming the broken invariants.

    ``plugin`` is a Connector class (built with ``settings_model`` validated from ``options``) or
    a ``factory(settings, role, instance_id)`` called with ``settings``. The hand-off checks use
    the tiny model in ``model_dir`` or write one to a temporary folder; skip them with
    ``skip={"handoff", "handoff_abort"}``.
    """
    return run_connector_checks(plugin, options=options, settings=settings, skip=skip,
                                model_dir=model_dir).raise_for_failures()


def run_connector_checks(plugin: type[Connector] | ConnectorFactory, *, options: Mapping[str, Any] | None = None,
                         settings: Any = None, skip: Collection[str] = (), model_dir: str | None = None) -> SeamReport:
    """Like :func:`check_connector`, but never raises for a broken invariant: every check gets a row."""
    if isinstance(plugin, type):
        if settings is None:
            settings = plugin_settings(plugin, options)
        cls = plugin

        def factory(s: Any, role: ConnectorRole, instance_id: str) -> Connector:
            return cls(s, role=role, instance_id=instance_id)
    elif options:
        raise ValueError("options are for a Connector class; pass a factory its settings instead")
    else:
        factory = plugin
    transport_names, handoff_names = _names(TRANSPORT_CHECKS), _names(HANDOFF_CHECKS)
    unknown = sorted(set(skip) - transport_names - handoff_names)
    if unknown:
        raise ValueError(f"no connector check named {', '.join(unknown)}; the checks are "
                         f"{', '.join(c.name for c in CONNECTOR_CHECKS)}")
    transport = run_checks(SEAM, describe(plugin), TRANSPORT_CHECKS, skip=set(skip) & transport_names,
                           args=(_Kit(factory, settings),))
    with HandoffRig(factory, settings, model_dir=model_dir) as rig:
        handoff = run_checks(SEAM, describe(plugin), HANDOFF_CHECKS, skip=set(skip) & handoff_names, args=(rig,))
    return SeamReport(SEAM, describe(plugin), transport.results + handoff.results)


def _names(checks: tuple[Check, ...]) -> set[str]:
    return {check.name for check in checks}


class _Kit:
    def __init__(self, factory: ConnectorFactory, settings: Any) -> None:
        self.factory = factory
        self.settings = settings

    @contextlib.contextmanager
    def pair(self) -> Iterator[tuple[Connector, str, Connector, str]]:
        """A started prefill and decode instance and their addresses; closed afterwards."""
        prefill = self.factory(self.settings, "prefill", "conformance-prefill")
        decode = None
        try:
            decode = self.factory(self.settings, "decode", "conformance-decode")
            prefill_address, decode_address = prefill.start(), decode.start()
            yield prefill, prefill_address, decode, decode_address
        finally:
            close(prefill)
            if decode is not None:
                close(decode)


def close(connector: Connector) -> None:
    try:
        connector.close()
    except Exception as exc:
        raise broken(SEAM, CLOSE, f"close() raised {type(exc).__name__}: {exc}") from exc


def receive_until(connector: Connector, count: int, timeout: float = PATIENCE_S) -> list[Delivery]:
    """Up to ``count`` deliveries, waiting at most ``timeout`` seconds in all."""
    deliveries: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(deliveries) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        delivery = connector.receive(min(left, 0.5))
        if delivery is not None:
            deliveries.append(delivery)
    return deliveries


def _message(seq: int) -> dict[str, Any]:
    """A control message of primitives of every kind the protocol uses."""
    return {"kind": "conformance", "id": f"req-{seq}", "seq": seq, "attempt": 1, "ratio": seq / 7,
            "flag": seq % 2 == 0, "none": None, "open": [[f"req-{seq}", 1], ["other", 2]],
            "nested": {"text": "héllo ✓", "n": -seq}}


# --- the checks ------------------------------------------------------------------------------

def _addresses(kit: _Kit) -> None:
    with kit.pair() as (_, prefill_address, __, decode_address):
        for address in (prefill_address, decode_address):
            if not isinstance(address, str) or not address:
                raise broken(SEAM, ADDRESSES, f"start() returned {address!r}, not an address string")
        if prefill_address == decode_address:
            raise broken(SEAM, ADDRESSES, f"two instances started side by side both have address {prefill_address!r}")


def _control_order(kit: _Kit) -> None:
    with kit.pair() as (prefill, prefill_address, decode, decode_address):
        for sender, sender_address, receiver, receiver_address, count in (
                (prefill, prefill_address, decode, decode_address, 40),
                (decode, decode_address, prefill, prefill_address, 10)):
            got: list[Delivery] = []
            for seq in range(count):
                _send_while_reading(sender, receiver_address, _message(seq), receiver, got)
            got += receive_until(receiver, count - len(got))
            seqs = [d.message.get("seq") for d in got]
            if seqs != list(range(count)):
                raise broken(SEAM, ORDER, f"{count} control messages sent in order arrived as {seqs} "
                                          f"(within {PATIENCE_S:g} s)")
            for delivery in got:
                if delivery.sender != sender_address:
                    raise broken(SEAM, ORDER, f"a message from {sender_address!r} arrived with sender "
                                              f"{delivery.sender!r}")
                want = _message(delivery.message["seq"])
                if delivery.message != want:
                    raise broken(SEAM, ORDER, f"control message {want['seq']} arrived as {delivery.message!r}, "
                                              f"sent as {want!r}")
                if delivery.buffers:
                    raise broken(SEAM, ORDER, "a control message arrived with block buffers")
            extra = receiver.receive(0.2)
            if extra is not None:
                raise broken(SEAM, ORDER, f"after the {count} messages sent, another arrived: {extra.message!r}")


def _send_while_reading(sender: Connector, address: str, message: dict[str, Any], receiver: Connector,
                        got: list[Delivery]) -> None:
    """Send ``message``; while the peer's queue is full (send returns False) let the receiver read."""
    deadline = time.monotonic() + PATIENCE_S
    while not sender.send(address, message):
        if time.monotonic() > deadline:
            raise broken(SEAM, ORDER, f"send of control message {message['seq']} kept returning False for "
                                      f"{PATIENCE_S:g} s to a live peer that reads")
        delivery = receiver.receive(0.05)
        if delivery is not None:
            got.append(delivery)


def _buffers(kit: _Kit) -> None:
    import numpy as np

    rng = np.random.default_rng(0)
    # one block of a tiny model: K and V of 2 layers, [kv_heads, block_size, head_dim] float32 each
    blocks = [[rng.standard_normal((2, 8, 16)).astype(np.float32) for _ in range(4)] for _ in range(3)]
    with kit.pair() as (prefill, _, decode, decode_address):
        # in a function of its own: the received views are gone before the connectors close
        _exchange_blocks(prefill, decode, decode_address, blocks)


def _exchange_blocks(prefill: Connector, decode: Connector, decode_address: str, blocks: list[list[Any]]) -> None:
    expected = [[a.tobytes() for a in block] for block in blocks]

    def views(i: int) -> list[memoryview]:
        return [memoryview(a).cast("B") for a in blocks[i]]

    def same(delivery: Delivery, i: int) -> bool:
        return [bytes(b) for b in delivery.buffers] == expected[i]

    for i in range(2):
        if not prefill.send(decode_address, {"kind": "block", "index": i}, views(i)):
            raise broken(SEAM, BUFFERS, f"send of block message {i} to a live peer returned False")
    first = receive_until(decode, 1)
    if not first:
        raise broken(SEAM, BUFFERS, f"block message 0 never arrived (waited {PATIENCE_S:g} s)")
    delivery = first[0]
    if delivery.message != {"kind": "block", "index": 0}:
        raise broken(SEAM, BUFFERS, f"the first block message arrived as {delivery.message!r}")
    if len(delivery.buffers) != 4 or not all(isinstance(b, memoryview) for b in delivery.buffers):
        raise broken(SEAM, BUFFERS, f"block message 0 arrived with {len(delivery.buffers)} buffers of types "
                                    f"{sorted({type(b).__name__ for b in delivery.buffers})}, sent with 4 memoryviews")
    if not same(delivery, 0):
        raise broken(SEAM, BUFFERS, "block message 0's buffers arrived with other bytes than were sent")
    # more traffic before the next receive: the first delivery's buffers must still hold
    if not prefill.send(decode_address, {"kind": "block", "index": 2}, views(2)):
        raise broken(SEAM, BUFFERS, "send of block message 2 to a live peer returned False")
    time.sleep(0.1)
    if not same(delivery, 0):
        raise broken(SEAM, BUFFERS, "block message 0's buffers changed before the next receive call")
    rest = receive_until(decode, 2)
    indexes = [d.message.get("index") for d in rest]
    if indexes != [1, 2]:
        raise broken(SEAM, BUFFERS, f"block messages 1 and 2 arrived as {indexes} (within {PATIENCE_S:g} s)")
    for i, later in zip((1, 2), rest, strict=True):
        if not same(later, i):
            raise broken(SEAM, BUFFERS, f"block message {i}'s buffers arrived with other bytes than were sent")


def _wake(kit: _Kit) -> None:
    grace, blocking = 1.5, 3.0
    with kit.pair() as (_, __, decode, ___):
        call = ThreadCall(lambda: decode.receive(blocking)).start()
        time.sleep(0.2)
        woken = time.monotonic()
        decode.wake()
        if not call.join(grace):
            call.join(blocking)   # its receive ends before the connectors close
            raise broken(SEAM, WAKE, f"receive(timeout={blocking:g}) went on blocking {grace} s after wake()")
        if call.value is not None:
            raise broken(SEAM, WAKE, f"a woken receive returned {call.value!r} with nothing sent")
        if time.monotonic() - woken > grace:
            raise broken(SEAM, WAKE, "receive returned long after wake()")


def _receive_timeout(kit: _Kit) -> None:
    with kit.pair() as (_, __, decode, ___):
        decode.receive(0.05)   # a wake-up left over from start() may end the first one early
        started = time.monotonic()
        got = decode.receive(0.2)
        elapsed = time.monotonic() - started
        if got is not None:
            raise broken(SEAM, TIMEOUT, f"receive(0.2) returned {got!r} with nothing sent")
        if elapsed > 0.2 + 1.0:
            raise broken(SEAM, TIMEOUT, f"receive(0.2) with nothing sent returned after {elapsed:.2f} s")


def _unknown_peer(kit: _Kit) -> None:
    import numpy as np

    gone = kit.factory(kit.settings, "decode", "conformance-gone")
    address = gone.start()
    close(gone)
    block = [memoryview(np.zeros((2, 8, 16), np.float32)).cast("B") for _ in range(4)]
    with kit.pair() as (prefill, _, __, ___):
        for what, buffers in (("a control message", ()), ("a block message", block)):
            for i in range(3):
                started = time.monotonic()
                sent = prefill.send(address, {"kind": "conformance", "seq": i}, buffers)
                elapsed = time.monotonic() - started
                if not isinstance(sent, bool):
                    raise broken(SEAM, UNKNOWN_PEER, f"send returned {sent!r}, not True or False")
                if elapsed > SEND_LIMIT_S:
                    raise broken(SEAM, UNKNOWN_PEER, f"send of {what} to {address!r}, whose instance closed, took "
                                                     f"{elapsed:.2f} s (more than {SEND_LIMIT_S:g} s)")
        prefill.forget_peer(address)
        started = time.monotonic()
        prefill.send(address, {"kind": "conformance", "seq": 99})
        if time.monotonic() - started > SEND_LIMIT_S:
            raise broken(SEAM, UNKNOWN_PEER, "send to a gone peer after forget_peer took more than "
                                             f"{SEND_LIMIT_S:g} s")


#: The transport checks, in the order they run (the hand-off checks follow, see :mod:`.handoff`).
TRANSPORT_CHECKS: Final = (
    Check("addresses", ADDRESSES, _addresses),
    Check("control_order", ORDER, _control_order),
    Check("block_buffers", BUFFERS, _buffers),
    Check("wake", WAKE, _wake),
    Check("receive_timeout", TIMEOUT, _receive_timeout),
    Check("unknown_peer", UNKNOWN_PEER, _unknown_peer),
)
#: Every connector check, in the order they run.
CONNECTOR_CHECKS: Final = TRANSPORT_CHECKS + HANDOFF_CHECKS
