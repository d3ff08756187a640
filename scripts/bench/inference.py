"""Benchmark the embedded (hf) inference server: throughput under concurrency and weight-update time.

    python scripts/bench/inference.py [--preset tiny|small] [--repeats 3] [--max-tokens 64]

Starts a real server subprocess on 127.0.0.1 with a locally built model, then measures
0. the round trip of a trivial request on a kept-alive connection (every request's fixed cost), and
   the latency of one e2e RL step's requests (8 concurrent groups, n=16, <= 10 tokens);
1. generated tokens/s with 1, 8 and 64 concurrent chat requests (each `--max-tokens`, ignore_eos), and
   with one request for n=64 choices (how the orchestrator asks for a single-turn group);
2. the wall time of one weight update from a path and over gloo, next to a raw in-memory copy of the
   same bytes (the floor any transport is measured against);
3. LoRA vs full policy sync, as LoRA RL does it each step: write (trainer side) + load on the server
   (verified), bytes and seconds, for the adapter (/load_lora_adapter) and for the merged weights
   (/update_weights from path). `--sync-only` measures just this.
Prints medians of `--repeats` runs as a Markdown table (docs/inference.md quotes it).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MSGS = [{"role": "user", "content": "Reverse the text: the quick brown fox"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def throughput(client, concurrency: int, max_tokens: int, n: int = 1) -> tuple[float, float]:
    """(generated tokens per second, mean decode batch size the server reported)."""
    before = await client.stats()
    t0 = time.perf_counter()
    rs = await asyncio.gather(
        *(
            client.chat_completion(MSGS, max_tokens=max_tokens, ignore_eos=True, tokens=False, n=n)
            for _ in range(concurrency)
        )
    )
    dt = time.perf_counter() - t0
    after = await client.stats()
    tokens = sum(r["usage"]["completion_tokens"] for r in rs)
    steps = sum(after["batch_size_hist"].values()) - sum(before["batch_size_hist"].values())
    rows = after["generated_tokens"] - before["generated_tokens"]
    return tokens / dt, rows / max(steps, 1)


async def round_trip(client, n: int = 30) -> tuple[str, str, str]:
    """Median of n GET /metrics on one kept-alive connection: the fixed cost every request pays (was
    ~44 ms from the 2nd request on, when Nagle held the response body for the client's delayed ACK)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await client.stats()
        times.append(time.perf_counter() - t0)
    return (
        "HTTP round trip on a kept-alive connection (GET /metrics)",
        f"{statistics.median(times) * 1e3:.2f} ms",
        f"median of {n}",
    )


async def rl_step(client, n: int = 20) -> tuple[str, str, str]:
    """Median latency of what the orchestrator sends for one step of the e2e workload: 8 concurrent
    group requests, n = 16 choices each, <= 10 tokens (the whole batch is done when the last is)."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await asyncio.gather(*(client.chat_completion(MSGS, max_tokens=10, n=16) for _ in range(8)))
        times.append(time.perf_counter() - t0)
    return (
        "one RL step's requests: 8 concurrent x n=16 x <=10 tokens",
        f"{statistics.median(times) * 1e3:.1f} ms",
        f"median of {n}",
    )


async def sync_rows(c, model_dir: Path, tmp: Path, args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """LoRA adapter vs full merged weights, per step: trainer-side write + verified server load."""
    import torch
    from safetensors.torch import load_file, save_file

    from hpcrl.models.load import LoraParams, apply_lora
    from hpcrl.models.spec import load_model
    from hpcrl.trainer.model import merged_state_dict, save_adapter
    from hpcrl.weights.checksum import state_dict_checksum

    model = apply_lora(load_model(model_dir), LoraParams(rank=args.lora_rank, alpha=2.0 * args.lora_rank))
    full_t, lora_t, full_b, lora_b = [], [], 0, 0
    for i in range(args.repeats):
        with torch.no_grad():  # a trained adapter: B is no longer zero
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 1e-3)
        t0 = time.perf_counter()
        d = save_adapter(model, tmp / f"adapter_{i}")
        ck = state_dict_checksum(load_file(str(d / "adapter_model.safetensors")))
        r = await c.load_lora_adapter("policy", str(d), step=200 + i)
        assert r["checksum"] == ck, "adapter checksum mismatch"
        lora_t.append(time.perf_counter() - t0)
        lora_b = sum(f.stat().st_size for f in d.iterdir())
        t0 = time.perf_counter()
        merged = merged_state_dict(model)
        full_dir = tmp / f"full_{i}"
        full_dir.mkdir()
        save_file({k: v.contiguous() for k, v in merged.items()}, str(full_dir / "model.safetensors"))
        await c.update_weights(300 + i, path=str(full_dir), expected_checksum=state_dict_checksum(merged))
        full_t.append(time.perf_counter() - t0)
        full_b = (full_dir / "model.safetensors").stat().st_size
    lt, ft = statistics.median(lora_t), statistics.median(full_t)
    return [
        (
            f"policy sync, LoRA rank {args.lora_rank} adapter (write + /load_lora_adapter, verified)",
            f"{lt * 1e3:.1f} ms",
            f"{lora_b / 2**20:.3f} MiB = {100 * lora_b / full_b:.1f} % of full",
        ),
        (
            "policy sync, full merged weights (write + /update_weights from path, verified)",
            f"{ft * 1e3:.1f} ms",
            f"{full_b / 2**20:.2f} MiB; LoRA {ft / lt:.1f}x faster",
        ),
    ]


async def run(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import load_file

    from hpcrl.inference.client import InferenceClient
    from hpcrl.models.tiny import build_tiny_model
    from hpcrl.weights.checksum import state_dict_checksum
    from hpcrl.weights.collective import broadcast_weights, init_group
    from tests.conftest import InferenceServer

    tmp = Path(tempfile.mkdtemp(prefix="hpcrl-bench-"))
    model_dir = build_tiny_model(tmp / "model", preset=args.preset, seed=0)
    new_dir = build_tiny_model(tmp / "model_step1", preset=args.preset, seed=1)
    new_sd = load_file(new_dir / "model.safetensors")
    nbytes = sum(t.numel() * t.element_size() for t in new_sd.values())
    server = InferenceServer(model_dir, tmp / "run", "--inference.max-batch-size", "64", threads=args.threads)
    rows: list[tuple[str, str, str]] = []
    try:
        async with InferenceClient(server.base_url) as c:
            await c.chat_completion(MSGS, max_tokens=4)  # warm-up
            rows.append(await round_trip(c))
            rows.append(await rl_step(c))
            rows += await sync_rows(c, model_dir, tmp, args)
            if args.sync_only:
                return _print(rows, args)
            for conc in (1, 8, 64):
                runs = [await throughput(c, conc, args.max_tokens) for _ in range(args.repeats)]
                tps = statistics.median(r[0] for r in runs)
                batch = statistics.median(r[1] for r in runs)
                rows.append(
                    (
                        f"generate, {conc} concurrent x {args.max_tokens} tokens",
                        f"{tps:,.0f} tok/s",
                        f"mean decode batch {batch:.1f}",
                    )
                )
            # What the orchestrator sends for a single-turn group: one request, n choices, one prefill.
            runs = [await throughput(c, 1, args.max_tokens, n=64) for _ in range(args.repeats)]
            rows.append(
                (
                    f"generate, 1 request n=64 x {args.max_tokens} tokens",
                    f"{statistics.median(r[0] for r in runs):,.0f} tok/s",
                    f"mean decode batch {statistics.median(r[1] for r in runs):.1f}",
                )
            )

            ck = state_dict_checksum(new_sd)
            times = []
            for i in range(args.repeats):
                t0 = time.perf_counter()
                await c.update_weights(i + 1, path=str(new_dir), expected_checksum=ck)
                times.append(time.perf_counter() - t0)
            rows.append(
                (
                    "update_weights from path (safetensors, verified)",
                    f"{statistics.median(times) * 1e3:.1f} ms",
                    f"{nbytes / 2**20:.1f} MiB",
                )
            )

            port = free_port()
            group, _ = await asyncio.gather(
                asyncio.to_thread(init_group, "127.0.0.1", port, 2, 0),
                c.init_broadcaster("127.0.0.1", port, 2, 1),
            )
            times = []
            for i in range(args.repeats):
                step = 100 + i
                t0 = time.perf_counter()
                await asyncio.gather(
                    asyncio.to_thread(broadcast_weights, group, new_sd, step, checksum=ck),
                    c.update_weights(step, collective=True, expected_checksum=ck),
                )
                times.append(time.perf_counter() - t0)
            rows.append(
                (
                    "update_weights over gloo (broadcast, verified)",
                    f"{statistics.median(times) * 1e3:.1f} ms",
                    f"{nbytes / 2**20:.1f} MiB",
                )
            )

        dst = {k: torch.empty_like(v) for k, v in new_sd.items()}
        times = []
        for _ in range(max(args.repeats, 5)):
            t0 = time.perf_counter()
            for k, v in new_sd.items():
                dst[k].copy_(v)
            times.append(time.perf_counter() - t0)
        rows.append(
            (
                "raw copy of the same bytes (torch copy_)",
                f"{statistics.median(times) * 1e3:.2f} ms",
                f"{nbytes / 2**20:.1f} MiB",
            )
        )
    finally:
        server.stop()
    _print(rows, args)


def _print(rows: list[tuple[str, str, str]], args: argparse.Namespace) -> None:
    print(
        f"\nhf backend, preset {args.preset}, server torch threads {args.threads}, median of {args.repeats}\n"
    )
    print("| measurement | median | note |\n|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=["tiny", "small"], default="tiny")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--sync-only", action="store_true", help="only the LoRA vs full sync comparison")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="server torch threads (1: OpenMP spinning collapses on a shared 2-core machine)",
    )
    args = p.parse_args()
    t0 = time.perf_counter()
    asyncio.run(run(args))
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
