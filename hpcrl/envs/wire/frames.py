"""Sending and receiving env messages in frames, on the orchestrator's ROUTER and a worker's DEALER.

A socket send that wakes ZMQ's I/O thread costs tens of microseconds, and on two busy cores far more
(a context switch); so did one asyncio poll + recv per message on the receiving side. A step's
rollouts move in bursts (32 Runs, then 32 Chats, 8 groups' replies, 32 Dones), so `Outbox` queues
what the event loop produces in one iteration and sends one frame per peer at the end of it, and
`drain` takes every frame already waiting after one wake-up. The delay this adds is one loop
iteration, never a timer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from hpcrl.envs.wire import messages as wire

log = logging.getLogger("hpcrl.envs.wire.frames")


class Outbox:
    """Messages put in one event-loop iteration leave as one frame per peer, in the order put.

    `routed`: the socket is a ROUTER and each frame is addressed (`ident`); a DEALER has one peer."""

    def __init__(self, sock: Any, routed: bool):
        self.sock, self.routed = sock, routed
        self.queued: dict[bytes, list[wire.Msg]] = {}
        self.scheduled = False
        self.frames = 0  # frames sent (tests and benchmarks read it)

    def put(self, msg: wire.Msg, ident: bytes = b"") -> None:
        self.queued.setdefault(ident, []).append(msg)
        if not self.scheduled:
            self.scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.scheduled = False
        queued, self.queued = self.queued, {}
        if self.sock.closed:
            return
        for ident, msgs in queued.items():
            data = wire.encode(*msgs)
            # zmq.asyncio sends at once when it can; else it keeps the order and finishes later
            sent = self.sock.send_multipart([ident, data] if self.routed else [data])
            sent.add_done_callback(_report)
            self.frames += 1


def _report(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("an env message was not sent: %s", fut.exception())


def drain(sock: Any, first: list[bytes], limit: int = 256) -> list[list[bytes]]:
    """`first` (a frame just received) and the frames already waiting behind it (at most `limit`, so
    a flood cannot starve the rest of the loop), without waiting."""
    import zmq

    out = [first]
    while len(out) < limit:
        try:
            out.append(sock.recv_multipart(zmq.NOBLOCK).result())
        except zmq.Again:
            break
    return out
