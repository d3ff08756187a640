"""Orchestrator per-step overhead of progress reporting and stall detection (issue 40; target <= 1 %).

What the reporting adds to one orchestrator step, measured piece by piece on this machine:
  hot path   progress.moved() per answered request (+ pool.quiet_since stamps), x requests per step
  thread     one pass of the progress thread (stall check, stalls/ scan, progress JSON write), x passes
             per step (the thread runs every poll_s; it takes the GIL while it runs)
  event loop one StallWatch tick (asyncio.sleep wake-up + lag bookkeeping), x ticks per step
and divided by the step time. Defaults: the CPU demo (configs/demo/rl.toml: 8 prompts x 16 = 128
requests, ~1 s per step on 2 cores); pass --step-s / --requests for another run.

    python scripts/bench/progress_overhead.py [--step-s 1.0] [--requests 128]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from hpcrl.monitor.progress import Progress


def per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-s", type=float, default=1.0)
    ap.add_argument("--requests", type=int, default=128)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp())
    p = Progress("bench", root / "progress", root / "stalls", bound_s=60.0, poll_s=3600)  # thread idle
    p.culprit = lambda idle: None
    stamps = [0.0]

    def hot() -> None:
        stamps[0] = time.monotonic()  # ServerPool.quiet_since
        p.moved("inference answered")

    hot_s = min(per_call(hot, 100_000) for _ in range(3))

    def thread_pass() -> None:
        now = time.monotonic()
        p._check(now, now - p.last)
        p._answer_requests()
        p.write(now, now - p.last)

    pass_s = min(per_call(thread_pass, 300) for _ in range(3))

    async def ticks(n: int) -> float:
        from hpcrl.orchestrator.stalls import TICK_S

        t0 = time.perf_counter()
        for _ in range(n):
            before = time.monotonic()
            await asyncio.sleep(0)
            lag = time.monotonic() - before - TICK_S  # the bookkeeping StallWatch.run does per tick
            _ = max(0.0, lag)
        return (time.perf_counter() - t0) / n

    tick_s = min(asyncio.run(ticks(20_000)) for _ in range(3))
    from hpcrl.monitor.progress import WRITE_EVERY_S
    from hpcrl.orchestrator.stalls import TICK_S

    poll_s = max(0.2, min(2.0, 60.0 / 10))  # Progress's poll for the default 60 s bound
    per_step = {
        "hot path": hot_s * args.requests,
        "progress thread": pass_s * args.step_s / min(poll_s, WRITE_EVERY_S),
        "event-loop ticks": tick_s * args.step_s / TICK_S,
    }
    total = sum(per_step.values())
    print(f"step {args.step_s:.3f} s, {args.requests} requests per step")
    print(f"  moved() + stamp     {hot_s * 1e9:8.0f} ns/call")
    print(f"  thread pass         {pass_s * 1e6:8.1f} us (every {min(poll_s, WRITE_EVERY_S):.1f} s)")
    print(f"  loop tick           {tick_s * 1e6:8.1f} us (every {TICK_S} s)")
    for k, v in per_step.items():
        print(f"  {k:<18} {v * 1e6:8.1f} us/step")
    print(f"overhead: {total * 1e3:.3f} ms per step = {100 * total / args.step_s:.3f} % of the step")
    p.stop()


if __name__ == "__main__":
    main()
