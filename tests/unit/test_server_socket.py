"""The inference server's listening socket (hpcrl/inference/options.bind_server_socket): every
connection it accepts must have Nagle off. With Nagle on, each response after the first on a
kept-alive connection waited ~40 ms for the client's delayed ACK (the server writes head and body
separately) — measured 44 ms per request against 1 ms (scripts/bench/inference.py, keep-alive row)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from hpcrl.errors import ConfigError
from hpcrl.inference.options import bind_server_socket


def _nodelay(s: socket.socket) -> bool:
    return bool(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))


def test_listener_is_tcp_with_nagle_off_and_accepted_connections_inherit_it():
    sock = bind_server_socket("127.0.0.1", 0)
    try:
        # asyncio only disables Nagle on transports whose socket says proto == IPPROTO_TCP
        assert sock.proto == socket.IPPROTO_TCP and _nodelay(sock)
        sock.listen(1)
        with socket.create_connection(sock.getsockname()) as client:
            conn, _ = sock.accept()
            with conn:
                assert conn.proto == socket.IPPROTO_TCP and _nodelay(conn)
                client.sendall(b"x")
                assert conn.recv(1) == b"x"
    finally:
        sock.close()


def test_asyncio_server_on_the_socket_serves_with_nagle_off():
    """What uvicorn does with it (loop.create_server(sock=...)): the transport's socket has Nagle off."""

    async def main() -> bool:
        sock = bind_server_socket("127.0.0.1", 0)
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class P(asyncio.Protocol):
            def connection_made(self, transport):
                seen.set_result(_nodelay(transport.get_extra_info("socket")))
                transport.close()

        server = await asyncio.get_running_loop().create_server(P, sock=sock)
        async with server:
            _, w = await asyncio.open_connection(*sock.getsockname())
            result = await asyncio.wait_for(seen, 10)
            w.close()
        return result

    assert asyncio.run(main()) is True


def test_taken_port_is_a_one_line_config_error():
    first = bind_server_socket("127.0.0.1", 0)
    first.listen(1)
    try:
        with pytest.raises(ConfigError, match="server.port"):
            # SO_REUSEADDR does not let a second socket bind a port that is being listened on
            bind_server_socket("127.0.0.1", first.getsockname()[1])
    finally:
        first.close()
