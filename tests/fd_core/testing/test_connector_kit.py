"""The connector kit: zmq and shm pass the transport and the hand-off; broken connectors are named."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import zmq

from fd_core.testing.conformance import (
    ConformanceError,
    check_connector,
    run_connector_checks,
)
from fd_plugins.connectors.shm_connector import ShmConnector
from fd_plugins.connectors.zmq_connector import ZmqConnector

TRANSPORT_ONLY = {"handoff", "handoff_abort"}


@pytest.mark.parametrize("cls", [ZmqConnector, ShmConnector])
def test_the_built_ins_pass_every_check_with_a_real_hand_off(cls, tiny_model_dir):
    report = check_connector(cls, model_dir=tiny_model_dir)
    assert all(r.status == "passed" for r in report.results), report
    assert [r.check for r in report.results][-2:] == ["handoff", "handoff_abort"]


def test_zmq_with_curve_keys_passes_every_check_with_a_real_hand_off(tiny_model_dir):
    secret = zmq.curve_keypair()[1].decode()   # one key pair for both instances
    report = check_connector(ZmqConnector, options={"curve_secret_key": secret}, model_dir=tiny_model_dir)
    assert all(r.status == "passed" for r in report.results), report


def test_a_factory_and_options_work():
    report = check_connector(lambda settings, role, instance_id: ZmqConnector(settings, role=role,
                                                                              instance_id=instance_id),
                             skip=TRANSPORT_ONLY)
    assert report.ok
    assert check_connector(ZmqConnector, options={"send_hwm": 10}, skip=TRANSPORT_ONLY).ok


def test_a_connector_that_drops_block_messages_is_caught(broken_plugins, tiny_model_dir):
    report = run_connector_checks(broken_plugins.connector.DropsBlocks, model_dir=tiny_model_dir)
    assert [r.check for r in report.failures] == ["block_buffers", "handoff"]
    assert report.result("block_buffers").reason == (
        "connector invariant 'block buffers arrive byte-identical and stay valid until the next receive' broken: "
        "block message 0 never arrived (waited 5 s)")
    assert report.result("handoff").reason.startswith(
        "connector invariant \"a prefill -> decode hand-off gives the mixed engine's output\" broken: request 'h0' "
        "ended with finish reason 'error'")
    with pytest.raises(ConformanceError, match="block buffers arrive byte-identical"):
        report.raise_for_failures()


class _Reorders(ZmqConnector):
    """Holds every other control message back and sends it after the next one."""

    held: tuple[str, dict[str, Any]] | None = None

    def send(self, peer: str, message: dict[str, Any], buffers: Sequence[memoryview] = ()) -> bool:
        if buffers or message.get("seq", 0) % 2:
            sent = super().send(peer, message, buffers)
            if self.held is not None:
                sent = super().send(*self.held) and sent
                self.held = None
            return sent
        self.held = (peer, message)
        return True


class _CorruptsBlocks(ZmqConnector):
    def send(self, peer: str, message: dict[str, Any], buffers: Sequence[memoryview] = ()) -> bool:
        return super().send(peer, message, [memoryview(bytes(b)[::-1]) for b in buffers])


class _Unwakeable(ZmqConnector):
    def wake(self) -> None:
        pass


class _WrongSender(ZmqConnector):
    def _delivery(self, sender: str, message: dict[str, Any], frames: list[memoryview]) -> Any:
        return super()._delivery("somebody-else", message, frames)


@pytest.mark.parametrize(("cls", "check", "message"), [
    (_Reorders, "control_order", "connector invariant 'control messages arrive in order, once each, from their "
                                 "sender' broken: 40 control messages sent in order arrived as [1, 0, 3, 2"),
    (_WrongSender, "control_order", "arrived with sender 'somebody-else'"),
    (_CorruptsBlocks, "block_buffers", "connector invariant 'block buffers arrive byte-identical and stay valid "
                                       "until the next receive' broken: block message 0's buffers arrived with "
                                       "other bytes than were sent"),
    (_Unwakeable, "wake", "connector invariant 'wake() makes a blocked receive return early' broken: "
                          "receive(timeout=3) went on blocking 1.5 s after wake()"),
])
def test_each_broken_transport_fails_naming_its_invariant(cls, check, message):
    report = run_connector_checks(cls, skip=TRANSPORT_ONLY)
    assert message in report.result(check).reason, report.result(check).reason
