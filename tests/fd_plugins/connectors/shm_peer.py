"""A shm connector in its own process, driven by the tests over stdin/stdout (one JSON line each way).

Commands: ``{"op": "send", "peer": address, "index": i}`` sends block ``i`` (answers ``sent``);
``{"op": "hold"}`` receives until a block arrives and keeps its buffers (answers its ``index``);
``{"op": "drain", "until": i, "seconds": s}`` checks the held block's bytes, then receives until
block ``i`` arrived or ``s`` seconds passed (answers ``held_ok`` and ``blocks``: [index, bytes
as sent] each).
"""

from __future__ import annotations

import json
import sys
import time

from fd_plugins.connectors.shm_connector import ShmConnector, ShmConnectorSettings

#: Bytes of each of a block's two buffers: two 512 KiB slots fit a 1 MiB segment.
BUFFER_BYTES = 256 << 10


def block(index: int) -> list[memoryview]:
    """Block ``index``'s buffers: bytes no other index has."""
    return [memoryview(bytes([index % 256]) * BUFFER_BYTES),
            memoryview(index.to_bytes(4, "little") * (BUFFER_BYTES // 4))]


def is_block(index: int, buffers: list[memoryview]) -> bool:
    return [bytes(b) for b in buffers] == [bytes(b) for b in block(index)]


def main() -> None:
    instance_id, socket_dir = sys.argv[1:3]
    connector = ShmConnector(ShmConnectorSettings(buffer_mb=1, socket_dir=socket_dir), role="decode",
                             instance_id=instance_id)
    _answer({"address": connector.start()})
    held = None
    for line in sys.stdin:
        command = json.loads(line)
        if command["op"] == "send":
            _answer({"sent": connector.send(command["peer"], {"kind": "block", "index": command["index"]},
                                            block(command["index"]))})
        elif command["op"] == "hold":
            held = _next_block(connector, time.monotonic() + 10)
            _answer({"index": held.message["index"]})
        elif command["op"] == "drain":
            held_ok = held is None or is_block(held.message["index"], held.buffers)
            held = None
            _answer({"held_ok": held_ok, "blocks": _drain(connector, command["until"], command["seconds"])})


def _next_block(connector: ShmConnector, deadline: float):
    while time.monotonic() < deadline:
        delivery = connector.receive(0.1)
        if delivery is not None and delivery.message.get("kind") == "block":
            return delivery
    raise TimeoutError("no block arrived")


def _drain(connector: ShmConnector, until: int, seconds: float) -> list[list[object]]:
    blocks: list[list[object]] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and (not blocks or blocks[-1][0] != until):
        delivery = connector.receive(0.1)
        if delivery is not None and delivery.message.get("kind") == "block":
            index = delivery.message["index"]
            blocks.append([index, is_block(index, delivery.buffers)])
    return blocks


def _answer(reply: dict[str, object]) -> None:
    print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
