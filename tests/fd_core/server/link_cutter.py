"""A TCP forwarder whose connections a test can cut, losing what was in flight on them.

Put in front of a zmq connector (the connector binds 127.0.0.1:PORT and advertises 127.0.0.2;
the forwarder listens on 127.0.0.2:PORT), :meth:`LinkCutter.cut` resets every open connection
(RST, like a peer's host vanishing from the network): bytes written by one side and not yet read
by the other are gone, and zmq reconnects through the forwarder.
"""

from __future__ import annotations

import socket
import struct
import threading


class LinkCutter:
    """Forwards ``listen`` -> ``target`` (``(host, port)`` each) until :meth:`close`."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.target = target
        self._server = socket.create_server(listen, reuse_port=False)
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self.cuts = 0
        self.accepted = 0   # connections forwarded so far
        threading.Thread(target=self._accept, name=f"link-cutter-{listen[1]}", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return   # closed
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()   # the target is down (killed): the peer retries
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open += [client, upstream]
                self.accepted += 1
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        self._reset(source, sink)

    def _reset(self, *sockets: socket.socket) -> None:
        """Close with SO_LINGER 0: the other end gets an RST and unread bytes are dropped (the
        read shutdown first wakes the pump blocked on the socket, which holds it open)."""
        with self._lock:
            for sock in sockets:
                if sock in self._open:
                    self._open.remove(sock)
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                        sock.shutdown(socket.SHUT_RD)
                    except OSError:
                        pass
                    try:
                        sock.close()
                    except OSError:
                        pass

    def cut(self) -> None:
        """Reset every connection open now."""
        with self._lock:
            current = list(self._open)
        self._reset(*current)
        self.cuts += 1

    def close(self) -> None:
        self._server.close()
        self.cut()
