"""The shm connector with its peers in real processes: a slot is never written while a receiver may
still read it, and a receiver unmaps the segments of senders that are gone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from fd_plugins.connectors.shm_connector import ShmConnector, ShmConnectorSettings

sys.path.insert(0, str(Path(__file__).parent))
from shm_peer import block, is_block  # noqa: E402


class Peer:
    """A shm connector in a child process (``shm_peer.py``)."""

    def __init__(self, instance_id: str, socket_dir: Path) -> None:
        self.process = subprocess.Popen([sys.executable, str(Path(__file__).with_name("shm_peer.py")), instance_id,
                                         str(socket_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.address = self._reply()["address"]

    def ask(self, **command: object) -> dict:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self._reply()

    def tell(self, **command: object) -> None:
        """Send a command whose answer is read later (:meth:`answer`)."""
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def answer(self) -> dict:
        return self._reply()

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)   # reaped: its pid is gone

    def _reply(self) -> dict:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line, f"the peer process exited ({self.process.wait(timeout=10)})"
        return json.loads(line)


@pytest.fixture
def make_peer(tmp_path: Path) -> Iterator:
    peers: list[Peer] = []

    def make(instance_id: str) -> Peer:
        peers.append(Peer(instance_id, tmp_path))
        return peers[-1]

    yield make
    for peer in peers:
        if peer.process.poll() is None:
            peer.kill()


@pytest.fixture
def connector(tmp_path: Path) -> Iterator[ShmConnector]:
    connector = ShmConnector(ShmConnectorSettings(buffer_mb=1, socket_dir=str(tmp_path)), role="prefill",
                             instance_id="here")
    connector.start()
    yield connector
    connector.close()


def _send_within(connector: ShmConnector, peer: str, index: int, seconds: float = 15.0) -> None:
    """Send block ``index``; a full segment is retried until the receiver hands slots back."""
    deadline = time.monotonic() + seconds
    while not connector.send(peer, {"kind": "block", "index": index}, block(index)):
        assert time.monotonic() < deadline, f"block {index}: no slot came back in {seconds} s"


def test_a_forgotten_receiver_gets_the_bytes_sent_for_each_block(connector, make_peer):
    receiver = make_peer("decode")
    assert connector.send(receiver.address, {"kind": "block", "index": 0}, block(0))
    assert connector.send(receiver.address, {"kind": "block", "index": 1}, block(1))   # both slots in use
    assert receiver.ask(op="hold") == {"index": 0}   # reading slot 0; block 1's notice waits in its inbox
    connector.forget_peer(receiver.address)   # e.g. a stalled transfer of this receiver
    sent_into_a_slot_in_use = connector.send(receiver.address, {"kind": "block", "index": 2}, block(2))
    receiver.tell(op="drain", until=4, seconds=20)
    _send_within(connector, receiver.address, 4)   # a slot comes back once the receiver gave it up
    drained = receiver.answer()
    assert drained["held_ok"], "the block held while the sender forgot its reader was overwritten"
    assert all(same for _, same in drained["blocks"]), drained   # block 1 (unless given up) and 4
    assert [index for index, _ in drained["blocks"]][-1] == 4
    assert not sent_into_a_slot_in_use   # the receiver could still read both slots: it waited for one


def test_the_slots_of_a_receiver_killed_while_holding_them_come_back(connector, make_peer, tmp_path):
    dead, other = make_peer("decode-dead"), make_peer("decode-live")
    assert connector.send(dead.address, {"kind": "block", "index": 0}, block(0))
    assert connector.send(dead.address, {"kind": "block", "index": 1}, block(1))
    assert dead.ask(op="hold") == {"index": 0}
    dead.kill()
    _send_within(connector, other.address, 2, seconds=5)   # without any forget_peer
    other.ask(op="hold")
    assert other.ask(op="drain", until=2, seconds=0) == {"held_ok": True, "blocks": []}


def _shm_mappings() -> set[tuple[str, str]]:
    """(inode, path) of this process's shared-memory mappings; a segment whose file was unlinked (a
    killed sender's resource tracker cleans up) is still mapped, its path then ends in "(deleted)"."""
    fields = (line.split(maxsplit=5) for line in Path("/proc/self/maps").read_text().splitlines())
    return {(f[4], f[5].removesuffix(" (deleted)")) for f in fields if len(f) == 6 and "/dev/shm/" in f[5]}


def test_a_receiver_unmaps_the_segment_of_a_sender_killed_with_sigkill(connector, make_peer):
    before = _shm_mappings()
    sender = make_peer("prefill")
    assert sender.ask(op="send", peer=connector.address, index=7) == {"sent": True}
    delivery = connector.receive(10)
    assert delivery is not None and is_block(7, delivery.buffers)
    del delivery
    assert len(_shm_mappings() - before) == 1
    sender.kill()
    deadline = time.monotonic() + 15
    while _shm_mappings() - before:
        assert time.monotonic() < deadline, "the dead sender's segment stayed mapped"
        connector.receive(0.2)
    assert connector.stats()["segments_unmapped"] == 1


def test_forgetting_a_sender_unmaps_its_segment_and_a_later_block_maps_it_again(connector, make_peer):
    before = _shm_mappings()
    sender = make_peer("prefill")
    for index in (3, 4):
        assert sender.ask(op="send", peer=connector.address, index=index) == {"sent": True}
        delivery = connector.receive(10)
        assert delivery is not None and is_block(index, delivery.buffers)
        del delivery
        assert len(_shm_mappings() - before) == 1
        connector.forget_peer(sender.address)
        assert _shm_mappings() == before
    assert os.path.exists(sender.address.removeprefix("ipc://"))
