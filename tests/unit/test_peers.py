"""hpcrl/inference/peers.py: the pieces that bound /init_broadcaster's join, without a server."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

from hpcrl.inference.peers import in_daemon_thread, wait_for_listener
from hpcrl.inference.protocol import APIError


def test_nothing_listening_is_a_502_naming_the_peer():
    # bound but never listening, held for the whole test: connections to it are refused, and no
    # other socket (another test's listener) can take the port meanwhile
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]

        async def main() -> None:
            start = time.monotonic()
            await wait_for_listener("127.0.0.1", port, start, start + 0.3)

        with pytest.raises(APIError) as e:
            asyncio.run(main())
    assert e.value.status == 502 and f"127.0.0.1:{port}" in e.value.message
    assert "ConnectionRefusedError" in e.value.message  # what the last attempt got


def test_a_listener_is_found():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()

        async def main() -> None:
            start = time.monotonic()
            await wait_for_listener("127.0.0.1", srv.getsockname()[1], start, start + 30)

        asyncio.run(main())


def test_a_result_after_the_answer_goes_to_on_late_not_the_request():
    release, late = threading.Event(), []
    done = threading.Event()

    def on_late(value):
        late.append(value)
        done.set()

    async def main() -> None:
        fut = in_daemon_thread(lambda: release.wait(30) and "group", on_late)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(fut, 0.05)  # the request is answered (504) without it
        release.set()
        await asyncio.to_thread(done.wait, 30)

    asyncio.run(main())
    assert late == ["group"]


def test_result_and_exception_reach_the_request():
    async def main() -> None:
        assert await in_daemon_thread(lambda: 7, lambda v: None) == 7
        with pytest.raises(ValueError, match="boom"):
            await in_daemon_thread(lambda: (_ for _ in ()).throw(ValueError("boom")), lambda v: None)

    asyncio.run(main())
