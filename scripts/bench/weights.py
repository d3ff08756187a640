"""Benchmark weight sync: cost curve of each transport against a raw baseline measured in the same run.

    python scripts/bench/weights.py --quick          # 10 / 64 / 256 MiB, ~1-2 min on 2 loaded cores
    python scripts/bench/weights.py                  # 10 MiB .. 1 GiB, --plot docs/weights_curve.png
    python scripts/bench/weights.py --ranks 1,2,4    # sharded publish vs today's, per trainer rank
                                                     # (scripts/bench/weights_sharded.py, its flags)

Synthetic bf16 state dicts shaped like a transformer (embedding, per layer q/k/v/o, gate/up/down, norms).
Each row is verified end to end: the receiver's checksum of what it loaded must equal the sender's.

- filesystem: hpcrl's PolicyPublisher (checksum, safetensors dir, atomic rename, fsync, PolicyReady on
  a real bus) then the server's load (hpcrl.inference.loading + copy into the served tensors +
  checksum), against raw = one write + fsync + read of as many bytes on the same disk;
- collective: hpcrl.weights.collective between two processes (checksum, header, chunked gloo
  broadcast, copy into the served tensors, checksum), against raw = one plain gloo broadcast of as many
  bytes on the same group. Both end when the receiver's 8-byte acknowledgement arrives.
- delta rows: consecutive bf16 policies (fp32 masters under AdamW, lr 1e-6, random gradients, after
  10 unpublished warm-up steps); full sync vs delta sync of the same policies, bytes and seconds per step.

Medians of --reps interleaved repetitions (raw and hpcrl alternate, so load hits both alike).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hpcrl.bus import Bus  # noqa: E402
from hpcrl.bus.files import read_bytes  # noqa: E402
from hpcrl.inference.loading import load_safetensors_dir  # noqa: E402
from hpcrl.paths import RunPaths  # noqa: E402
from hpcrl.trainer.publish import PolicyPublisher  # noqa: E402
from hpcrl.weights import collective as coll  # noqa: E402
from hpcrl.weights.checksum import state_dict_checksum  # noqa: E402
from hpcrl.weights.delta import Delta, apply_delta, read_delta_dir  # noqa: E402

MiB = 1 << 20
KIND_STOP, KIND_RAW, KIND_FULL = 0, 1, 2


# -- synthetic policies ---------------------------------------------------------------------------
def transformer_shapes(total_bytes: int, layers: int = 4, itemsize: int = 2) -> dict[str, tuple[int, ...]]:
    """Qwen-like names and shapes whose bytes add up to about `total_bytes`."""
    # per layer: q,k,v,o (4 h^2) + gate,up,down (3 * h * 2h) = 10 h^2; embedding 8h x h; norms ~0
    h = max(64, int(math.sqrt(total_bytes / itemsize / (10 * layers + 8))) // 64 * 64)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (8 * h, h), "model.norm.weight": (h,)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for m in ("q_proj", "k_proj", "v_proj", "o_proj"):
            shapes[f"{p}.self_attn.{m}.weight"] = (h, h)
        shapes[f"{p}.mlp.gate_proj.weight"] = (2 * h, h)
        shapes[f"{p}.mlp.up_proj.weight"] = (2 * h, h)
        shapes[f"{p}.mlp.down_proj.weight"] = (h, 2 * h)
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
    return shapes


def make_policy(
    total_bytes: int, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: (torch.randn(s, generator=g) * 0.02).to(dtype) for n, s in transformer_shapes(total_bytes).items()
    }


def nbytes(named: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in named.values())


def alternate(rep: int, *pairs: tuple) -> tuple:
    """Swap the order every repetition, so neither side always runs right after the other's I/O."""
    return pairs if rep % 2 == 0 else pairs[::-1]


# -- filesystem -----------------------------------------------------------------------------------
def fs_receive(path: str, params: dict[str, torch.Tensor], want: str) -> None:
    """What the hf server does for /update_weights {path}: read, copy into the model (or apply the
    delta in place), checksum the full weights."""
    delta = read_delta_dir(path)
    if delta is not None:
        apply_delta(params, delta)
    else:
        for n, t in load_safetensors_dir(path).items():
            params[n].copy_(t)
    got = state_dict_checksum(params)
    assert got == want, (got, want)


def raw_file_roundtrip(path: Path, buf: torch.Tensor) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        mv = memoryview(buf.numpy())
        while mv:
            mv = mv[os.write(fd, mv) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    back, _ = read_bytes(path)
    assert back.size == buf.numel()


def bench_filesystem(root: Path, sizes: list[int], reps: int) -> list[dict]:
    paths = RunPaths(root / "run")
    bus = Bus(paths, "trainer", 0, listen=False)
    pub = PolicyPublisher(paths, bus, 0, "filesystem", keep=2)
    rows, step = [], 0
    for size in sizes:
        policy = make_policy(size)
        params = {n: torch.empty_like(t) for n, t in policy.items()}
        raw = torch.randint(0, 255, (nbytes(policy),), dtype=torch.uint8)
        ours, theirs = [], []

        def hpcrl_sync(step: int, policy=policy, params=params) -> None:
            pub.publish_named(policy, step)
            msg = bus.latest_policy()
            assert msg is not None and msg.step == step
            fs_receive(msg.path, params, msg.checksum)

        def raw_sync(step: int, raw=raw) -> None:
            raw_file_roundtrip(root / f"raw_{step}.bin", raw)  # a new file, as each broadcast is
            (root / f"raw_{step}.bin").unlink()

        for rep in range(reps + 1):  # the first round warms allocator and page cache: dropped
            step += 1
            for fn, out in alternate(rep, (hpcrl_sync, ours), (raw_sync, theirs)):
                t0 = time.perf_counter()
                fn(step)
                out.append(time.perf_counter() - t0)
        rows.append(row("filesystem", size, nbytes(policy), ours[1:], theirs[1:]))
        print_row(rows[-1])
        del policy, params, raw
    bus.close()
    return rows


# -- collective -----------------------------------------------------------------------------------
def _control(group: coll.WeightGroup, kind: int = 0, size: int = 0) -> tuple[int, int]:
    t = torch.tensor([kind, size], dtype=torch.int64)
    coll._broadcast(group, t, 0)
    return int(t[0]), int(t[1])


def _ack(group: coll.WeightGroup, ok: int = 0) -> int:
    t = torch.tensor([ok], dtype=torch.int64)
    coll._broadcast(group, t, 1)
    return int(t[0])


def _into(params: dict[str, torch.Tensor]):
    """The hf engine's (sink, rows): large parts land in their rows of the served tensor, the small
    ones are copied there from the round buffer."""

    def rows(name: str, row0: int, n: int) -> torch.Tensor:
        p = params[name]
        return p if p.dim() == 0 else p[row0 : row0 + n]

    def sink(parts: list) -> list:
        out = []
        for name, row0, view in parts:
            dst = rows(name, row0, view.shape[0] if view.dim() else 1)
            out.append(dst if dst.data_ptr() == view.data_ptr() else dst.copy_(view))
        return out

    return sink, rows


def receiver_main(port: int) -> None:
    """Rank 1: what the hf server does for /update_weights {transport: collective}, in a loop."""
    group = coll.init_group("127.0.0.1", port, 2, 1, backend="gloo")
    params: dict[str, torch.Tensor] = {}
    raw = torch.empty(0, dtype=torch.uint8)
    while True:
        kind, size = _control(group)
        if kind == KIND_STOP:
            break
        if kind == KIND_RAW:
            if raw.numel() != size:
                raw = torch.empty(size, dtype=torch.uint8)
            coll._broadcast(group, raw, 0)
            _ack(group, 1)
            continue
        header = coll.receive_header(group)
        if header.delta is not None:  # what the engine does: apply in place, checksum the full result
            apply_delta(params, Delta.from_manifest(header.delta, coll.receive_tensors(group, header)))
            ok = state_dict_checksum(params) == header.checksum
        else:  # what the engine does: each part copied into the served tensor, digested where it landed
            if {n: (d, tuple(s)) for n, d, s in header.tensors} != {
                n: (str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in params.items()
            }:
                params = {n: torch.empty(s, dtype=getattr(torch, d)) for n, d, s in header.tensors}

            ok = coll.receive_into(group, header, *_into(params)) == header.checksum
        _ack(group, int(ok))
    coll.destroy_group(group)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_collective(
    sizes: list[int], reps: int, bucket_mb: float, delta_args: tuple | None = None
) -> tuple[list[dict], list[dict]]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--receiver", str(port)])
    group = coll.init_group("127.0.0.1", port, 2, 0, backend="gloo")
    rows, step, deltas = [], 0, []
    try:
        for size in sizes:
            policy = make_policy(size)
            raw = torch.randint(0, 255, (nbytes(policy),), dtype=torch.uint8)
            ours, theirs = [], []

            def hpcrl_sync(step: int, policy=policy) -> None:
                _control(group, KIND_FULL, 0)
                # the checksum comes from the parts' digests (one pass), as in the sharded publish
                coll.broadcast_weights(group, policy, step, bucket_mb=bucket_mb)
                assert _ack(group) == 1, "receiver's checksum differs from the sender's"

            def raw_sync(step: int, raw=raw) -> None:
                _control(group, KIND_RAW, raw.numel())
                coll._broadcast(group, raw, 0)
                assert _ack(group) == 1

            for rep in range(reps + 1):
                step += 1
                for fn, out in alternate(rep, (hpcrl_sync, ours), (raw_sync, theirs)):
                    t0 = time.perf_counter()
                    fn(step)
                    out.append(time.perf_counter() - t0)
            rows.append(row("collective", size, nbytes(policy), ours[1:], theirs[1:]))
            print_row(rows[-1])
            del policy, raw
        deltas = bench_delta(delta_args[0], *delta_args[1:], group) if delta_args else []
        _control(group, KIND_STOP, 0)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        coll.destroy_group(group)
    return rows, deltas


# -- delta vs full -------------------------------------------------------------------------------
def bf16_run(size: int, steps: int, lr: float, warmup: int = 10):
    """Consecutive bf16 policies from fp32 master weights under torch's AdamW (lr, betas 0.9/0.999)
    driven by random gradients, published as bf16 — what a trainer with fp32 masters sends each step.
    The first `warmup` steps are not published: Adam's first steps move every weight by ~lr (the
    bias-corrected m/sqrt(v) is ~1), later ones by a fraction of it, as in a long run."""
    master = [torch.nn.Parameter(t) for t in make_policy(size, dtype=torch.float32).values()]
    names = list(transformer_shapes(size))
    opt = torch.optim.AdamW(master, lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    for i in range(warmup + steps + 1):
        if i >= warmup:
            yield {n: p.detach().to(torch.bfloat16) for n, p in zip(names, master)}
        for p in master:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def bench_delta(root: Path, size: int, steps: int, lr: float, group: coll.WeightGroup | None) -> list[dict]:
    """Per step: delta sync then full sync of the same policy (the receiver holds the previous one
    before the delta); seconds end to end (publish + load + verify) and bytes sent."""
    transport = "collective" if group is not None else "filesystem"
    paths = RunPaths(root / f"delta_{transport}")
    bus = Bus(paths, "trainer", 0, listen=False)
    pubs = {
        mode: PolicyPublisher(
            paths, bus, 0, transport, keep=2, weight_group=group, delta=mode == "delta", full_every=10**9
        )
        for mode in ("delta", "full")
    }
    params: dict[str, torch.Tensor] = {}
    t: dict[str, list[float]] = {"delta": [], "full": []}
    b: dict[str, list[int]] = {"delta": [], "full": []}
    step = 0
    for i, policy in enumerate(bf16_run(size, steps, lr)):
        if not params:
            params = {n: torch.empty_like(v) for n, v in policy.items()}
        for mode in ("delta", "full"):
            step += 1
            pub = pubs[mode]
            t0 = time.perf_counter()
            if group is not None:
                _control(group, KIND_FULL, 0)
            pub.publish_named(policy, step)
            if group is not None:
                assert _ack(group) == 1, "receiver's checksum differs from the sender's"
            else:
                msg = bus.latest_policy()
                fs_receive(msg.path, params, msg.checksum)
            if i > 0:  # step 0 is the first (full) sync of both
                t[mode].append(time.perf_counter() - t0)
                b[mode].append(pub.last_sync_bytes)
    bus.close()
    out = []
    for mode in ("full", "delta"):
        out.append(
            {
                "transport": transport,
                "mode": mode,
                "nominal_mib": size // MiB,
                "steps": steps,
                "seconds": statistics.median(t[mode]),
                "bytes": statistics.median(b[mode]),
            }
        )
    full, delta = out
    print(
        f"{transport:<11} {size // MiB:5d} MiB bf16, lr {lr:g}, {steps} steps:  full {full['bytes'] / MiB:7.1f} MiB "
        f"{full['seconds'] * 1e3:7.1f} ms   delta {delta['bytes'] / MiB:6.2f} MiB {delta['seconds'] * 1e3:7.1f} ms"
        f"   bytes {delta['bytes'] / full['bytes'] * 100:4.1f} % (target <= 5 %), time delta/full {delta['seconds'] / full['seconds']:4.2f}x",
        flush=True,
    )
    return out


# -- report ---------------------------------------------------------------------------------------
def row(transport: str, nominal: int, size: int, ours: list[float], theirs: list[float]) -> dict:
    s, r = statistics.median(ours), statistics.median(theirs)
    return {
        "transport": transport,
        "nominal_mib": nominal // MiB,
        "bytes": size,
        "seconds": s,
        "raw_seconds": r,
        "gbps": size / s / 1e9,
        "raw_gbps": size / r / 1e9,
        "ratio": r / s,
        "reps": len(ours),
    }


def print_row(r: dict) -> None:
    print(
        f"{r['transport']:<11} {r['nominal_mib']:5d} MiB  hpcrl {r['seconds'] * 1e3:8.1f} ms "
        f"{r['gbps']:5.2f} GB/s   raw {r['raw_seconds'] * 1e3:8.1f} ms {r['raw_gbps']:5.2f} GB/s   "
        f"ratio {r['ratio']:4.2f}x",
        flush=True,
    )


def fit(rows: list[dict], key: str = "seconds") -> tuple[float, float]:
    """Least-squares t = a + b * bytes: (fixed overhead s, seconds per GB)."""
    xs = [r["bytes"] / 1e9 for r in rows]
    ys = [r[key] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-12, sum((x - mx) ** 2 for x in xs))
    return my - b * mx, b


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for transport, color in (("filesystem", "tab:blue"), ("collective", "tab:orange")):
        rs = [r for r in rows if r["transport"] == transport]
        if not rs:
            continue
        mb = [r["bytes"] / MiB for r in rs]
        ax.plot(mb, [r["seconds"] for r in rs], "o-", color=color, label=f"{transport} (hpcrl, verified)")
        ax.plot(mb, [r["raw_seconds"] for r in rs], "x--", color=color, label=f"{transport} raw baseline")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("state dict size (MiB, bf16)")
    ax.set_ylabel("seconds per sync (median)")
    ax.set_title("weight sync cost, 2-core CPU VM")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main() -> None:
    if "--ranks" in sys.argv:  # sharded publish vs today's gather, 1/2/4 trainer ranks: its own script
        os.execv(
            sys.executable,
            [sys.executable, str(Path(__file__).with_name("weights_sharded.py")), *sys.argv[1:]],
        )
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10 / 64 / 256 MiB only")
    ap.add_argument("--sizes", type=str, default=None, help="comma-separated MiB, e.g. 10,100,1024")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--transports", default="filesystem,collective")
    ap.add_argument("--bucket-mb", type=float, default=256, help="trainer.broadcast.chunk_mb")
    ap.add_argument("--dir", type=Path, default=REPO / "outputs" / "bench_weights", help="scratch dir (disk)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows here")
    ap.add_argument("--plot", type=Path, default=None, help="write the cost curve PNG here")
    ap.add_argument(
        "--delta-mib", type=int, default=None, help="delta rows: policy size (quick 64, else 256)"
    )
    ap.add_argument("--delta-steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-6, help="delta rows: AdamW learning rate")
    ap.add_argument("--receiver", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.receiver:
        receiver_main(args.receiver)
        return
    torch.set_num_threads(1)  # two processes share two cores
    if args.sizes:
        sizes = [int(float(x) * MiB) for x in args.sizes.split(",")]
    elif args.quick:
        sizes = [10 * MiB, 64 * MiB, 256 * MiB]
    else:
        sizes = [m * MiB for m in (10, 32, 64, 128, 256, 512, 1024)]
    transports = args.transports.split(",")
    delta_size = (args.delta_mib or (64 if args.quick else 256)) * MiB
    t_start = time.time()
    rows: list[dict] = []
    deltas: list[dict] = []
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    if "filesystem" in transports:
        root = Path(tempfile.mkdtemp(dir=args.dir))
        rows += bench_filesystem(root, sizes, args.reps)
        deltas += bench_delta(root, delta_size, args.delta_steps, args.lr, None)
    if "collective" in transports:
        more, more_deltas = bench_collective(
            sizes, args.reps, args.bucket_mb, (args.dir, delta_size, args.delta_steps, args.lr)
        )
        rows += more
        deltas += more_deltas
    shutil.rmtree(args.dir, ignore_errors=True)
    print()
    for transport in transports:
        rs = [r for r in rows if r["transport"] == transport]
        if len(rs) >= 2:
            a, b = fit(rs)
            ra, rb = fit(rs, "raw_seconds")
            big = [r["ratio"] for r in rs if r["nominal_mib"] >= 256]
            target = 0.8 if transport == "filesystem" else 0.5
            print(
                f"{transport:<11} fit: {a * 1e3:6.1f} ms + {b:6.3f} s/GB (raw {ra * 1e3:6.1f} ms + {rb:6.3f} s/GB)"
                f"   ratio >= 256 MiB: {min(big) if big else float('nan'):.2f}x (target >= {target})"
            )
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "delta": deltas}, indent=1))
    if args.plot:
        plot(rows, args.plot)
    print(f"\n{os.cpu_count()} cpus, total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
