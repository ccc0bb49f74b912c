"""The listening socket of fd-serve and the router: connections accepted through it have
``TCP_NODELAY`` set (without it, every response after the first on a keep-alive connection
waited ~40 ms for the client's delayed ACK)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from fd_core.server.main import bind_listener


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_accepted_connections_have_tcp_nodelay(host: str) -> None:
    if host == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 here")

    async def nodelay_of_an_accepted_connection() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        listener = bind_listener(host, 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        async with server:
            _, writer = await asyncio.open_connection(host, listener.getsockname()[1])
            value = await asyncio.wait_for(accepted, 10)
            writer.close()
        return value

    try:
        assert asyncio.run(nodelay_of_an_accepted_connection()) != 0
    except OSError as exc:   # e.g. IPv6 disabled in this network namespace
        if host == "::1":
            pytest.skip(f"no IPv6 loopback: {exc}")
        raise
