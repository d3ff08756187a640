"""Issue 53: rollout throughput of fixed in-flight caps against the adaptive controller, on an embedded
server whose KV capacity is deliberately small.

    python scripts/bench/concurrency.py [--preset tiny|small] [--kv-tokens 512] [--slice 5]
                                        [--rounds 6] [--caps 4,16,64,256]

One real inference server (hpcrl.inference.server, the hf engine) with `--inference.kv-cache-tokens`
small; the orchestrator's own ServerPool, controller and /metrics poller (poll every 1 s instead of
5 s: a short run) send single-turn rollouts of the demo task (reverse-text-demo prompts, max_tokens 10,
one completion per request, the pool kept full). The settings take turns in slices of `--slice`
seconds, `--rounds` times, in one process, each keeping its own pool and controller across its
slices (so a slow spell of a shared machine hits every setting alike). Per setting: medians over its
slices of rollouts/s, generated tokens/s and rollouts per CPU-second of the server process (robust
to other load on the machine), the server's preemptions (its /metrics), and the cap it ran at.
No trainer and no weight updates: only the rollout path the cap governs. Prints a Markdown table
(docs/observability.md quotes it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

POLL_S = 1.0  # the controller's poll interval here (5 s in a run): a short benchmark
DRAIN_S = 1.0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc)."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


class Setting:
    """One cap (fixed) or the adaptive controller, with its own pool, kept across slices so that the
    controller's state carries on; its poller runs only during its own slices."""

    def __init__(self, url: str, model: str, cap: int | None, ceiling: int):
        from hpcrl.orchestrator.concurrency.controller import Controller
        from hpcrl.orchestrator.concurrency.poller import Poller
        from hpcrl.orchestrator.pool import ServerPool

        self.cap, self.model = cap, model
        self.name = f"fixed {cap}" if cap else f"adaptive (<= {ceiling})"
        top = cap or ceiling
        self.top = top
        self.pool = ServerPool([url], model=model, timeout=600, max_concurrent=top)
        self.ctl = Controller(min_inflight=1, max_inflight=top, adaptive=cap is None, poll_interval_s=POLL_S)
        self.poller = Poller(self.pool, self.ctl, max_model_len=64, api_key=None)
        self.limits: list[int] = []

    async def slice(self, prompts: list, seconds: float, rng: random.Random, server_pid: int) -> dict:
        from hpcrl.orchestrator.concurrency.prometheus import parse, server_load

        # another setting ran in between: its preemptions and queue are not this controller's
        self.ctl.prev_preemptions.clear()
        self.ctl.prev_waiting.clear()
        before = server_load(parse(await self.pool.clients[0].metrics_text()))
        await self.poller.poll_once()
        poll_task = asyncio.create_task(self.poller.run())
        done: list[tuple[float, int]] = []
        t0, cpu0 = time.monotonic(), cpu_seconds(server_pid)
        end = t0 + seconds

        async def worker() -> None:
            while time.monotonic() < end:
                msgs = rng.choice(prompts)
                r = await self.pool.call(
                    self.pool.pick(), "chat_completion", msgs, model=self.model, max_tokens=10
                )
                done.append((time.monotonic(), int(r["usage"]["completion_tokens"])))

        async def sample_limits() -> None:
            while time.monotonic() < end:
                self.limits.append(self.pool.limiter.limit)
                await asyncio.sleep(0.5)

        workers = [asyncio.create_task(worker()) for _ in range(self.top + 8)]
        sampler = asyncio.create_task(sample_limits())
        await asyncio.sleep(seconds)
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, sampler, return_exceptions=True)
        poll_task.cancel()
        await asyncio.gather(poll_task, return_exceptions=True)
        cpu = cpu_seconds(server_pid) - cpu0
        after = server_load(parse(await self.pool.clients[0].metrics_text()))
        await asyncio.sleep(DRAIN_S)  # cancelled requests leave the server before the next slice
        return {
            "setting": self.name,
            "rollouts_s": len(done) / seconds,
            "tokens_s": sum(n for _, n in done) / seconds,
            "per_cpu_s": len(done) / max(cpu, 1e-3),
            "preemptions": after.preemptions - before.preemptions,
        }


async def bench(args: argparse.Namespace, url: str, model: str, server_pid: int) -> tuple[list[dict], list]:
    from hpcrl.envs.builtin.reverse_text_demo import load_environment

    env = load_environment()
    prompts = [env.initial_messages(t) for t in env.tasks("train")[:512]]
    caps = [int(c) for c in args.caps.split(",") if c]
    settings = [Setting(url, model, cap, max(caps)) for cap in [*caps, None]]
    rng = random.Random(0)
    rows: list[dict] = []
    for rnd in range(args.rounds):
        for st in settings:
            r = await st.slice(prompts, args.slice, rng, server_pid)
            r["round"] = rnd
            rows.append(r)
            print(
                f"  round {rnd} {r['setting']:>18}: {r['rollouts_s']:.1f} rollouts/s, "
                f"{r['per_cpu_s']:.1f} per server CPU-s, {r['preemptions']} preemptions, cap {st.pool.limiter.limit}",
                flush=True,
            )
    for st in settings:
        await st.pool.aclose()
    return rows, settings


def table(rows: list[dict], settings: list) -> str:
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["setting"], []).append(r)
    fields = ("rollouts_s", "tokens_s", "per_cpu_s")
    med = {k: {f: statistics.median(x[f] for x in v) for f in fields} for k, v in by.items()}
    pre = {k: sum(x["preemptions"] for x in v) for k, v in by.items()}
    fixed = [v for k, v in med.items() if k.startswith("fixed")]
    best = max((v["rollouts_s"] for v in fixed), default=0.0) or 1.0
    best_cpu = max((v["per_cpu_s"] for v in fixed), default=0.0) or 1.0
    caps = {st.name: st.limits for st in settings}
    lines = [
        "| setting | rollouts/s | tokens/s | rollouts per server CPU-s | preemptions (total) "
        "| vs best fixed (rollouts/s, per CPU-s) | cap (median, last) |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, v in med.items():
        lim = caps.get(k) or [0]
        lines.append(
            f"| {k} | {v['rollouts_s']:.1f} | {v['tokens_s']:.0f} | {v['per_cpu_s']:.1f} | {pre[k]} | "
            f"{v['rollouts_s'] / best:.2f}, {v['per_cpu_s'] / best_cpu:.2f} | "
            f"{statistics.median(lim):.0f}, {lim[-1]} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=["tiny", "small"], default="tiny")
    p.add_argument("--kv-tokens", type=int, default=512, help="the server's KV capacity (tokens)")
    p.add_argument("--slice", type=float, default=5.0, help="seconds of one setting in one round")
    p.add_argument("--rounds", type=int, default=6, help="rounds over all settings (interleaved)")
    p.add_argument("--caps", default="4,16,64,256", help="fixed caps to compare")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    args = p.parse_args()

    from hpcrl.models.tiny import build_tiny_model
    from tests.conftest import InferenceServer

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model_dir = build_tiny_model(tmp / "model", preset=args.preset, seed=0)
        server = InferenceServer(
            model_dir, tmp / "run", "--inference.max-batch-size", "256", "--inference.max-model-len", "64",
            "--inference.kv-cache-tokens", str(args.kv_tokens), threads=args.threads,
        )  # fmt: skip
        try:
            print(
                f"server: {args.preset} model, KV capacity {args.kv_tokens} tokens, max_model_len 64",
                flush=True,
            )
            rows, settings = asyncio.run(bench(args, server.base_url, str(model_dir), server.proc.pid))
        finally:
            server.stop()
    print()
    print(table(rows, settings))


if __name__ == "__main__":
    main()
