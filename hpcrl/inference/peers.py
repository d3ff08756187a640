"""Control routes that dial a peer answer within a bounded time, naming the peer and what was tried.

/init_broadcaster joins the trainer's weight group: a TCPStore rendezvous at host:port, then the process
group. torch's own timeouts do not bound that: against a closed port its client retries past its
timeout (6-9 s for a 3 s timeout here), and against a peer that accepts and never answers the store
handshake blocks for good. So:

1. a plain TCP connect is retried until something accepts at host:port (a trainer may write its
   address a moment before its store listens) or the deadline passes: 502, "nothing accepted";
2. the join then runs in a daemon thread, awaited until the deadline: 504 if it is not done ("accepted
   but the rendezvous did not complete": a silent or slow peer), 502 with torch's reason if it fails.
   A join that completes after its request was answered is torn down, never installed.

The deadline is the request's `join_timeout`, else the server's `server.control_timeout_s` (8 s: under
the 10 s a caller or probe may allow). The group's own operation timeout stays the request's `timeout`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

from hpcrl.inference.protocol import APIError

DEFAULT_CONTROL_TIMEOUT_S = 8.0
_RETRY_S = 0.1


def _error(status: int, message: str, param: str | None = None) -> APIError:
    return APIError(message, status=status, type="BroadcastError", param=param)


async def wait_for_listener(host: str, port: int, start: float, deadline: float) -> None:
    """Return once a TCP connection to host:port is accepted (and closed again); APIError 502 naming
    the peer when none is accepted before `deadline` (time.monotonic(), tried since `start`)."""
    last = "no attempt"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _error(
                502,
                f"nothing accepted a TCP connection at {host}:{port} within the join deadline "
                f"(tried for {time.monotonic() - start:.1f} s; last: {last}): is the trainer's weight broadcast "
                "group up there?",
            )
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), min(left, 2.0))
        except (OSError, asyncio.TimeoutError) as e:
            last = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            await asyncio.sleep(min(_RETRY_S, max(0.0, deadline - time.monotonic())))
            continue
        writer.close()
        return


def in_daemon_thread(fn: Callable[[], Any], on_late: Callable[[Any], None]) -> asyncio.Future:
    """Run fn() in a daemon thread (a stuck join must not hold the process at exit, as the default
    executor's threads would); its result or exception lands in the returned future. A result that
    arrives after the future was cancelled (the request was answered) is handed to `on_late`."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future = loop.create_future()

    def deliver(ok: bool, value: Any) -> None:
        if fut.cancelled():
            if ok:
                on_late(value)
        elif ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def run() -> None:
        try:
            value, ok = fn(), True
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting request
            value, ok = e, False
        try:
            loop.call_soon_threadsafe(deliver, ok, value)
        except RuntimeError:  # the loop is closed: the server is gone
            if ok:
                on_late(value)

    threading.Thread(target=run, name="hpcrl-join", daemon=True).start()
    return fut


async def join_weight_group(
    host: str,
    port: int,
    world: int,
    rank: int,
    *,
    backend: str | None,
    timeout_s: float,
    join_timeout_s: float,
) -> Any:
    """The hf server's join: a WeightGroup, or APIError 502/504 naming host:port within join_timeout_s."""
    from hpcrl.weights.collective import destroy_group, init_group

    start = time.monotonic()
    deadline = start + join_timeout_s
    await wait_for_listener(host, port, start, deadline)
    what = (
        f"joining the weight broadcast group (TCPStore rendezvous at {host}:{port}, rank {rank} of {world})"
    )
    fut = in_daemon_thread(
        lambda: init_group(
            host, port, world, rank, backend=backend, timeout_s=timeout_s, join_timeout_s=join_timeout_s
        ),
        destroy_group,
    )
    try:
        return await asyncio.wait_for(fut, max(0.0, deadline - time.monotonic()))
    except asyncio.TimeoutError:
        raise _error(
            504,
            f"{host}:{port} accepted the connection but {what} did not complete within "
            f"{join_timeout_s:g} s (a silent or slow peer; raise `join_timeout` or "
            "server.control_timeout_s if the trainer needs longer)",
            param="join_timeout",
        ) from None
    except Exception as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]  # torch appends C++ frames
        raise _error(502, f"{what} failed after {time.monotonic() - start:.1f} s: {reason}") from e
