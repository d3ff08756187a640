"""Protocol 4's per-round constants (hpcrl.weights.rounds): seconds per sync against the round size.

    python scripts/bench/weight_rounds.py --json outputs/bench_weight_rounds/result.json   # ~2 min

One sender (`broadcast_weights`, group rank 0) and a receiving server on gloo over 127.0.0.1, every
process on one torch thread (OMP_NUM_THREADS=1): a synthetic bf16 policy shaped like a transformer
(scripts/bench/weights.py's make_policy, --mib), sent at each --buckets round size (bucket_mb). The
receiver does what the hf engine does: `receive_into` with the engine's sink, large parts landing
straight in their rows of preallocated served tensors, the small ones copied there; it checks the
checksum and acknowledges (an all-reduce: the sync ends when every receiving process is done).
- 1 process: a server of one process (the hf engine), world 2;
- ring of 2: one server of 2 processes (`servers=((1, 2),)`, world 3): rounds alternate origins and
  each is passed on to the other process, both copying every part into their own tensors.
Per setup a least-squares fit of seconds = a + b * rounds: b = seconds per round; the bytes are the
same at every round size, so a / bytes = the per-byte cost (incl. a few ms per sync of header and
acknowledgement). Ring - 1 process: the in-server pass-on (+ the copies into the parameters, which
the single process does not make: memcpy is measured apart). Also on one thread: torch memcpy of
32 MiB (the engine's copy into its parameters: load per bucket) and `parts_digests` over the policy
cut into 32 MiB rounds (the digest each receiving process makes of each round it loads).
Medians of --reps repetitions after one warm-up (round sizes take turns, so load hits all alike).

Measured on the shared 2-core box, load average 1.7-2.0 (other jobs), --reps 15, 42 s:

    setup      bucket MiB rounds  s/sync     min     max   GB/s      (policy 253.5 MiB bf16, 38 tensors)
    1 process           4     79   0.210   0.192   0.234  1.267
    1 process          16     19   0.181   0.166   0.205  1.472
    1 process          64      4   0.163   0.135   0.195  1.628
    1 process         256      1   0.174   0.165   0.199  1.526
    ring of 2           4     79   0.381   0.357   0.401  0.697
    ring of 2          16     19   0.324   0.292   0.381  0.821
    ring of 2          64      4   0.318   0.287   0.383  0.837
    ring of 2         256      1   0.333   0.302   0.366  0.797
    1 process  fit: 0.168 s + 0.53 ms/round; per byte 0.634 s/GB (1.58 GB/s)
    ring of 2  fit: 0.320 s + 0.74 ms/round; per byte 1.203 s/GB (0.83 GB/s)
    in-server pass-on (ring - 1 process): +0.570 s/GB (+0.433 less one memcpy), +0.22 ms/round
    memcpy 32 MiB: 7.31 GB/s (4.6 ms); parts_digests in 32 MiB rounds: 6.83 GB/s (4.9 ms/round)

Three more runs of 7 reps (load 1.4-1.9): per round 1.81 / 0.49 / 0.39 ms (1 process), 1.20 / 0.69 /
1.00 ms (ring); per byte 0.65-0.78 s/GB (1 process), 1.17-1.28 (ring); pass-on +0.51-0.53 s/GB;
memcpy 5.1-7.7 GB/s, digest 7.3-7.7 GB/s. So a round costs ~0.5-2 ms (the 79-round point carries the
fit; 64 and 256 MiB are within noise of each other), the bytes ~0.65 s/GB of which ~0.28 are the two
digests (sender's, before the header, and receiver's, at ~7 GB/s each) and the rest gloo over
loopback; a second process in the server adds ~0.5 s/GB: its copy into the parameters (~0.14 s/GB),
its digest and the hop, three processes sharing 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"  # before torch; the receivers inherit it
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from weights import _into, make_policy, nbytes  # noqa: E402  (_into: the hf engine's sink)

from hpcrl.net import free_port  # noqa: E402
from hpcrl.weights import collective as coll  # noqa: E402
from hpcrl.weights.checksum import parts_digests  # noqa: E402
from hpcrl.weights.shards import full_piece  # noqa: E402

MiB = 1 << 20
SETUPS = {"1 process": 2, "ring of 2": 3}  # label: world size (rank 0 sends, the rest is one server)


def servers(world: int) -> tuple[tuple[int, int], ...]:
    return ((1, world - 1),) if world > 2 else ()  # (): one server per receiving rank


def _control(group: coll.WeightGroup, go: int = 0) -> int:
    t = torch.tensor([go], dtype=torch.int64)
    coll._broadcast(group, t, 0)
    return int(t[0])


def _ack(group: coll.WeightGroup, ok: int = 0, rounds: int = 0) -> tuple[int, int]:
    """Every rank: summed (receivers whose checksum matched, rounds they saw)."""
    t = torch.tensor([ok, rounds], dtype=torch.int64)
    group.pg.allreduce([t]).wait()
    return int(t[0]), int(t[1])


def receiver(port: int, world: int, rank: int) -> None:
    torch.set_num_threads(1)
    group = coll.init_group("127.0.0.1", port, world, rank, backend="gloo", servers=servers(world))
    params: dict[str, torch.Tensor] = {}
    while _control(group):
        header = coll.receive_header(group)
        if not params:  # preallocated once, as a server's parameters
            params = {n: torch.empty(s, dtype=getattr(torch, d)) for n, d, s in header.tensors}
        ok = coll.receive_into(group, header, *_into(params)) == header.checksum
        _ack(group, int(ok), len(header.rounds))
    coll.destroy_group(group)


def sync_rows(label: str, policy: dict[str, torch.Tensor], buckets: list[float], reps: int) -> list[dict]:
    world = SETUPS[label]
    port = free_port()
    procs = [
        subprocess.Popen([sys.executable, __file__, "--receiver", str(port), str(world), str(r)])
        for r in range(1, world)
    ]
    group = coll.init_group("127.0.0.1", port, world, 0, backend="gloo", servers=servers(world))
    times: dict[float, list[float]] = {b: [] for b in buckets}
    rounds: dict[float, int] = {}
    try:
        for rep in range(reps + 1):  # rep 0 warms buffers, parameters and page faults: dropped
            for step, b in enumerate(buckets if rep % 2 == 0 else buckets[::-1]):
                t0 = time.perf_counter()
                _control(group, 1)
                coll.broadcast_weights(group, policy, rep * 100 + step, bucket_mb=b)
                ok, n = _ack(group)
                dt = time.perf_counter() - t0
                assert ok == world - 1, f"{label}, bucket {b} MiB: a receiver's checksum differs"
                rounds[b] = n // (world - 1)
                if rep:
                    times[b].append(dt)
        _control(group, 0)
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        coll.destroy_group(group)
    size = nbytes(policy)
    return [
        {"setup": label, "bucket_mb": b, "rounds": rounds[b], "seconds": statistics.median(ts),
         "min": min(ts), "max": max(ts), "gbps": size / statistics.median(ts) / 1e9, "all": ts}
        for b, ts in times.items()
    ]  # fmt: skip


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b * x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(1e-12, sum((x - mx) ** 2 for x in xs))
    return my - b * mx, b


def timed(fn, reps: int) -> float:
    """Median seconds of `fn()` over `reps` calls after one warm-up."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def local_rates(policy: dict[str, torch.Tensor], reps: int) -> dict:
    src = torch.randn(16 * MiB).to(torch.bfloat16)  # 32 MiB
    dst = torch.empty_like(src)
    memcpy = timed(lambda: dst.copy_(src), reps)
    bkts = coll.plan_buckets((full_piece(n, t) for n, t in policy.items()), 32 * MiB)
    rounds = [[(p.tensor, p.row0) for p in b] for b in bkts]
    digest = timed(lambda: [parts_digests(r) for r in rounds], reps)
    return {
        "memcpy_gbps": 32 * MiB / memcpy / 1e9,
        "memcpy_ms_per_32mib": memcpy * 1e3,
        "digest_gbps": nbytes(policy) / digest / 1e9,
        "digest_ms_per_round": digest / len(rounds) * 1e3,
        "digest_rounds": len(rounds),
    }


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="policy size (nominal MiB, bf16)")
    ap.add_argument("--buckets", default="4,16,64,256", help="round sizes (bucket_mb)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--receiver", nargs=3, type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.receiver:
        return receiver(*args.receiver)
    torch.set_num_threads(1)
    t_start, loads = time.time(), [loadavg()]
    policy = make_policy(args.mib * MiB)
    size = nbytes(policy)
    res: dict = {"bytes": size, "reps": args.reps, "cpus": os.cpu_count(), "rows": [], "fit": {}}
    res.update(local_rates(policy, args.reps))
    loads.append(loadavg())
    buckets = [float(x) for x in args.buckets.split(",")]
    print(f"policy {size / MiB:.1f} MiB bf16, {len(policy)} tensors; medians of {args.reps} after a warm-up")
    print(f"{'setup':<10} {'bucket MiB':>10} {'rounds':>6} {'s/sync':>7} {'min':>7} {'max':>7} {'GB/s':>6}")
    for label in args.setups.split(","):
        rows = sync_rows(label, policy, buckets, args.reps)
        loads.append(loadavg())
        for r in rows:
            print(f"{label:<10} {r['bucket_mb']:>10g} {r['rounds']:>6} {r['seconds']:7.3f} {r['min']:7.3f} "
                  f"{r['max']:7.3f} {r['gbps']:6.3f}", flush=True)  # fmt: skip
        a, b = fit([r["rounds"] for r in rows], [r["seconds"] for r in rows])
        res["rows"] += rows
        res["fit"][label] = {"intercept_s": a, "s_per_round": b, "s_per_gb": a / (size / 1e9)}
    print()
    for label, f in res["fit"].items():
        print(f"{label:<10} fit: {f['intercept_s']:.3f} s + {f['s_per_round'] * 1e3:.2f} ms/round; "
              f"per byte {f['s_per_gb']:.3f} s/GB ({1 / f['s_per_gb']:.2f} GB/s)")  # fmt: skip
    if len(res["fit"]) == 2:
        one, ring = res["fit"].values()
        res["pass_on"] = {
            "s_per_gb": ring["s_per_gb"] - one["s_per_gb"],
            "s_per_gb_less_memcpy": ring["s_per_gb"] - one["s_per_gb"] - 1 / res["memcpy_gbps"],
            "s_per_round": ring["s_per_round"] - one["s_per_round"],
        }
        p = res["pass_on"]
        print(f"in-server pass-on (ring - 1 process): {p['s_per_gb']:+.3f} s/GB ({p['s_per_gb_less_memcpy']:+.3f} "
              f"less one memcpy), {p['s_per_round'] * 1e3:+.2f} ms/round")  # fmt: skip
    print(f"memcpy 32 MiB: {res['memcpy_gbps']:.2f} GB/s ({res['memcpy_ms_per_32mib']:.1f} ms); parts_digests "
          f"in 32 MiB rounds: {res['digest_gbps']:.2f} GB/s ({res['digest_ms_per_round']:.1f} ms/round)")  # fmt: skip
    res["loadavg"], res["seconds"] = loads, round(time.time() - t_start, 1)
    print(f"load average (1/5/15 min) start, after local, after each setup: {loads}; {res['seconds']:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
