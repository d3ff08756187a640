"""Benchmark the sharded publish against today's gather path: 1, 2 and 4 gloo trainer ranks.

    python scripts/bench/weights.py --ranks 1,2,4            # (delegates here) ~5-8 min on 2 loaded cores
    python scripts/bench/weights_sharded.py --ranks 1,2,4 --steps 3 --layers 10

A Qwen3-style model built locally (no hub; 10 layers, hidden 1024, vocab 151,936, tied: 313 M
parameters, fp32 master weights, bf16 policy of 0.63 GB) on meta, FSDP2-sharded (``apply_fsdp``),
materialised shard by shard. Each trainer rank runs ``PolicyPublisher.publish`` for --steps policies
(filesystem transport) with ``sharded`` false (today: every rank gathers the whole policy, rank 0
writes one file) or true (every rank writes its own rows, rank 0 the manifest). Per rank: the peak
RSS above the RSS before the publish (sampled every 5 ms: what the publish holds), seconds, bytes
written. Then one receiver process loads the newest policy as the hf server does
(``load_safetensors_dir``: assembled and verified piece by piece for the sharded one) and checks its
checksum against the announced one; "seconds to verified" = the slowest rank's publish + that load.
Collective: one receiver process joins the weight group (gloo) with every trainer rank, receives
every policy, verified bucket by bucket on receipt and against the policy checksum; "seconds to
verified" = from the publish's start to the end of that receive; "sent" is what each rank sent as a
source (sharded: its own pieces, point to point to the receiver; today: rank 0 everything).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak RSS of this process while the block runs (a 5 ms sampling thread)."""

    def __enter__(self) -> PeakRSS:
        self.base = _rss()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.005)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())


def build_model(layers: int):
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from hpcrl.models import parallelize as mp

    cfg = Qwen3Config(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151_936,
        tie_word_embeddings=True,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model = mp.apply_fsdp(model)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(
        1 + (torch.distributed.get_rank() if torch.distributed.is_initialized() else 0)
    )
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.copy_(torch.randn(local.shape, generator=g) * 0.02)
    return model


def worker(spec: str, layers: int, steps: int, bucket_mb: float, run_dir: str, out: str) -> None:
    import gc

    import torch

    from hpcrl.bus import Bus
    from hpcrl.paths import RunPaths
    from hpcrl.trainer import parallel as par
    from hpcrl.trainer.publish import PolicyPublisher

    env = par.init_distributed(torch.device("cpu"))
    mode, transport, port = spec.split(":")
    group = None
    if transport == "collective":  # every trainer rank is a member (a sender); the receiver is the last
        from hpcrl.weights.collective import init_group

        group = init_group(
            "127.0.0.1", int(port), env.world_size + 1, env.rank, backend="gloo", timeout_s=600,
            senders=env.world_size,
        )  # fmt: skip
    model = build_model(layers)
    paths = RunPaths(run_dir)
    if env.rank == 0:
        paths.make_dirs()
    par.barrier()
    rows = []
    with Bus(paths, "trainer", env.rank, listen=False) as bus:
        pub = PolicyPublisher(
            paths, bus, env.rank, transport, keep=2, weight_group=group, bucket_mb=bucket_mb,
            dtype="bfloat16", sharded=mode == "sharded", shard_bucket_mb=bucket_mb,
        )  # fmt: skip
        for step in range(steps):
            gc.collect()
            par.barrier()
            with PeakRSS() as m:
                start = time.time()
                t0 = time.perf_counter()
                pub.publish(model, step)
                par.barrier()
                dt = time.perf_counter() - t0
            if transport == "collective":  # what this rank broadcast as a source (its own pieces)
                written = (
                    pub.last_rank_bytes
                    if mode == "sharded"
                    else (pub.last_sync_bytes if env.rank == 0 else 0)
                )
            elif mode == "sharded":
                written = pub.last_rank_bytes
            else:
                f = paths.broadcast_dir(step) / "model.safetensors"
                written = f.stat().st_size if env.rank == 0 else 0
            rows.append(
                {
                    "step": step,
                    "start": start,
                    "s": dt,
                    "held": m.peak - m.base,
                    "rss": m.peak,
                    "bytes": written,
                }
            )
    Path(out).write_text(json.dumps({"rank": env.rank, "rows": rows}))
    par.barrier()
    par.destroy_distributed()


def receive_collective(port: str, world: str, steps: str, out: str) -> None:
    """A server of the weight group (its last rank): receive --steps policies, each verified bucket by
    bucket as it arrives and against the policy checksum (receive_tensors raises otherwise); note when."""
    from hpcrl.weights.collective import init_group, receive_header, receive_tensors

    group = init_group("127.0.0.1", int(port), int(world), int(world) - 1, backend="gloo", timeout_s=600)
    done, held = [], 0
    for _ in range(int(steps)):
        with PeakRSS() as m:
            header = receive_header(group)
            t0 = time.perf_counter()
            got = receive_tensors(group, header)
            ok = header.checksum is not None and len(got) == len(header.tensors)
            done.append({"at": time.time(), "ok": ok, "s": time.perf_counter() - t0})
            del got
        held = max(held, m.peak - m.base)
    Path(out).write_text(json.dumps({"done": done, "held": held}))


def receive(path: str, checksum: str, out: str) -> None:
    from hpcrl.inference.loading import load_safetensors_dir
    from hpcrl.weights.checksum import state_dict_checksum

    with PeakRSS() as m:
        t0 = time.perf_counter()
        got = load_safetensors_dir(path)
        ok = state_dict_checksum(got) == checksum
        dt = time.perf_counter() - t0
    Path(out).write_text(json.dumps({"s": dt, "ok": ok, "held": m.peak - m.base}))


def run_one(world: int, spec: str, args: argparse.Namespace, scratch: Path) -> dict:
    from hpcrl.bus import PolicyReady, read_message
    from hpcrl.net import free_port
    from hpcrl.paths import RunPaths
    from hpcrl.runtime import rank_env

    mode, transport = spec.split(":")
    tag = f"{mode}_{transport}_w{world}"
    run = scratch / tag
    port = free_port()
    procs, outs = [], []
    rec_out = scratch / f"{tag}_recv.json"
    receiver = None
    wport = free_port() if transport == "collective" else 0
    if transport == "collective":
        receiver = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--receive-collective",
                str(wport),
                str(world + 1),
                str(args.steps),
                str(rec_out),
            ]  # fmt: skip
        )
    for r in range(world):
        out = scratch / f"{tag}_r{r}.json"
        env = {**os.environ, **rank_env(r, world, "127.0.0.1", port), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--worker", f"{spec}:{wport}", str(args.layers), str(args.steps)]
        cmd += [str(args.bucket_mb), str(run), str(out)]
        procs.append(subprocess.Popen(cmd, env=env))
        outs.append(out)
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"{spec} on {world} rank(s) failed: exit {p.returncode}")
    ranks = [json.loads(o.read_text()) for o in outs]
    last = args.steps - 1
    msg = read_message(RunPaths(run).policy_file(last), PolicyReady)
    pub_s = statistics.median(max(r["rows"][s]["s"] for r in ranks) for s in range(args.steps))
    if receiver is not None:
        assert receiver.wait() == 0
        got = json.loads(rec_out.read_text())
        assert all(d["ok"] for d in got["done"]), f"{spec} w{world}: a received checksum differs"
        starts = [ranks[0]["rows"][s]["start"] for s in range(args.steps)]
        total = statistics.median(d["at"] - t for d, t in zip(got["done"], starts, strict=True))
        rec = {"s": statistics.median(d["s"] for d in got["done"]), "held": got["held"]}
    else:
        subprocess.run(
            [sys.executable, __file__, "--receive", msg.path or "", msg.checksum, str(rec_out)], check=True
        )
        rec = json.loads(rec_out.read_text())
        assert rec["ok"], f"{spec} w{world}: the receiver's checksum differs from the announced one"
        total = pub_s + rec["s"]
    return {
        "world": world,
        "mode": mode,
        "transport": transport,
        "held": [max(row["held"] for row in r["rows"]) for r in ranks],
        "peak_rss": [max(row["rss"] for row in r["rows"]) for r in ranks],
        "bytes": [r["rows"][last]["bytes"] for r in ranks],
        "publish_s": pub_s,
        "load_s": rec["s"],
        "total_s": total,
        "recv_held": rec["held"],
        "policy_bytes": msg.num_bytes,
    }


def table(rows: list[dict]) -> list[str]:
    gb = 1e9
    base = {(r["mode"], r["transport"]): r for r in rows if r["world"] == 1}
    lines = [
        "| ranks | transport | path | held by publish, per rank (GB) | largest / 1-rank today | peak RSS, largest rank (GB) "
        "| written/sent per rank (GB) | publish s | server load+verify s | s to verified | vs today |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    today = {(r["world"], r["transport"]): r for r in rows if r["mode"] == "today"}
    for r in rows:
        ref = base.get(("today", r["transport"])) or r
        t = today.get((r["world"], r["transport"]), r)
        lines.append(
            f"| {r['world']} | {r['transport']} | {r['mode']} | {' / '.join(f'{h / gb:.2f}' for h in r['held'])} "
            f"| {max(r['held']) / max(ref['held']):.2f}x | {max(r['peak_rss']) / gb:.2f} "
            f"| {' / '.join(f'{b / gb:.2f}' for b in r['bytes'])} | {r['publish_s']:.2f} | {r['load_s']:.2f} "
            f"| {r['total_s']:.2f} | {r['total_s'] / t['total_s']:.2f}x |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument(
        "--modes", default="today:filesystem,sharded:filesystem,today:collective,sharded:collective"
    )
    ap.add_argument("--layers", type=int, default=10, help="decoder layers (10: 313 M parameters)")
    ap.add_argument("--steps", type=int, default=3, help="policies published per run (median seconds)")
    ap.add_argument("--bucket-mb", type=float, default=256, help="trainer.broadcast.bucket_mb")
    ap.add_argument("--dir", type=Path, default=REPO / "outputs" / "bench_weights_sharded")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    ap.add_argument("--receive", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--receive-collective", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        mode, layers, steps, bucket, run, out = args.worker
        return worker(mode, int(layers), int(steps), float(bucket), run, out)
    if args.receive:
        return receive(*args.receive)
    if args.receive_collective:
        return receive_collective(*args.receive_collective)
    args.dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for world in (int(x) for x in args.ranks.split(",")):
            for mode in args.modes.split(","):
                rows.append(run_one(world, mode, args, Path(tmp)))
                print(json.dumps(rows[-1]), flush=True)
    print("\n".join(table(rows)))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
