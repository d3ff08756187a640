"""Benchmark the bus: hand-off latency, large-batch throughput, codec speed. Prints one table.

    python scripts/bench/bus.py                 # ~30 s on 2 cores; --dir picks the disk to test

(a) latency from the writer's rename to the reader (another process) holding the decoded batch,
    with the doorbell and with plain 1 s polling; both sides stamp time.time() on one machine.
(b) write+read of a 64 MiB TrainBatch through the bus (frame, checksum, fsync, rename, dir fsync,
    read, verify, decode) against a raw write+fsync+read of as many bytes on the same disk.
(c) encode+decode of a 1M-token TrainBatch against the same data as per-token lists in msgpack.
(d) fan-out (also alone: --fanout): one orchestrator publishes rollouts/step_N/rank_R for 1, 16, 64
    and 256 trainer-rank readers, each a real Bus waiting on its own file with its own doorbell;
    and one trainer publishes policy/step_N to 1..64 doorbell subscribers (Bus.wait_policy).
    Readers are threads, FANOUT_PROCS processes holding R/FANOUT_PROCS buses each: every reader
    still has its own PULL socket, endpoint file and wait loop, so the writer side (files, endpoint
    stats, PUSH sockets, rings) is exactly that of R processes; 256 processes on 2 cores would
    measure the VM's scheduler, not the bus (on a cluster 256 ranks sit on 32+ nodes).
(e) writer (--writer, ~1 min): seconds to publish one step's rank files (small batches) for 64, 256
    and 1024 ranks, the old way (publish_batch per rank: each file fsynced, renamed and its
    directory fsynced in turn) against publish_batches (a thread pool, one directory fsync per
    step), alternating in the same run; medians and the ratio new/old.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hpcrl.bus import Bus, PolicyReady, TrainBatch, decode, encode  # noqa: E402
from hpcrl.bus.files import read_bytes, read_message, write_message  # noqa: E402
from hpcrl.paths import RunPaths  # noqa: E402

TOKEN_BYTES = 17  # int32 ids + int32 positions + bool mask + float32 advantages + float32 logprobs


def make_batch(tokens: int, step: int = 0, sample_len: int = 1024) -> TrainBatch:
    rng = np.random.default_rng(step)
    lens = [sample_len] * (tokens // sample_len) + ([tokens % sample_len] if tokens % sample_len else [])
    seq_lens = np.array(lens, dtype=np.int32)
    s = len(seq_lens)
    return TrainBatch(
        step=step,
        rank=0,
        world_size=1,
        input_ids=rng.integers(0, 150_000, tokens, dtype=np.int32),
        position_ids=np.concatenate([np.arange(n, dtype=np.int32) for n in lens]),
        seq_lens=seq_lens,
        loss_mask=rng.random(tokens) < 0.7,
        advantages=rng.standard_normal(tokens, dtype=np.float32),
        inference_logprobs=-rng.random(tokens, dtype=np.float32),
        policy_versions=np.full(s, step, dtype=np.int32),
        temperatures=np.ones(s, dtype=np.float32),
        env_names=["reverse_text"] * s,
        example_ids=np.arange(s, dtype=np.int64),
        rewards=rng.random(s, dtype=np.float32),
        total_loss_tokens=tokens,
    )


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


# -- (a) latency ------------------------------------------------------------------------------------
def reader_main(root: str, mode: str, count: int, out: str) -> None:
    listen = mode == "doorbell"
    bus = Bus(RunPaths(root), "trainer", 0, listen=listen, poll_interval=0.5 if listen else 1.0)
    print("ready", flush=True)
    held = {}
    for step in range(count):
        batch = bus.wait_batch(step, timeout=60)
        held[step] = time.time()
        assert batch.step == step
    Path(out).write_text(json.dumps(held))
    bus.close()


def bench_latency(root: Path, mode: str, count: int, gap: tuple[float, float], tokens: int) -> list[float]:
    paths = RunPaths(root / f"latency_{mode}")
    out = root / f"latency_{mode}.json"
    reader = subprocess.Popen(
        [sys.executable, __file__, "--reader", str(paths.root), mode, str(count), str(out)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert reader.stdout is not None and reader.stdout.readline().strip() == "ready"
    writer = Bus(paths, "orchestrator", listen=False)
    batch = make_batch(tokens)
    renamed = {}
    rng = random.Random(0)
    for step in range(count):
        time.sleep(rng.uniform(*gap))  # random phase against the reader's poll clock
        batch.step = step
        writer.publish_batch(step, 0, batch)
        renamed[step] = writer.last_renamed_at
    assert reader.wait(timeout=120) == 0
    writer.close()
    held = {int(k): v for k, v in json.loads(out.read_text()).items()}
    return [held[s] - renamed[s] for s in range(count)]


# -- (b) throughput ---------------------------------------------------------------------------------
def bench_throughput(root: Path, mib: int, reps: int, checksum: str) -> tuple[float, float]:
    """Median seconds of (bus write+read, raw write+fsync+read) of `mib` MiB."""
    tokens = mib * (1 << 20) // TOKEN_BYTES
    batch = make_batch(tokens)
    raw = np.random.default_rng(1).integers(0, 255, tokens * TOKEN_BYTES, dtype=np.uint8)
    bus_file, raw_file = root / "tp" / "rank_0.msgpack", root / "tp" / "raw.bin"
    bus_t, raw_t = [], []
    for _ in range(reps + 1):  # first round warms the page cache and allocator; dropped
        t0 = time.perf_counter()
        write_message(bus_file, batch, checksum=checksum)
        out = read_message(bus_file, TrainBatch)
        bus_t.append(time.perf_counter() - t0)
        assert out.num_tokens == tokens
        t0 = time.perf_counter()
        fd = os.open(raw_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, raw)
        os.fsync(fd)
        os.close(fd)
        back, _ = read_bytes(raw_file)
        raw_t.append(time.perf_counter() - t0)
        assert len(back) == len(raw)
        del out, back
    return statistics.median(bus_t[1:]), statistics.median(raw_t[1:])


# -- (c) codec --------------------------------------------------------------------------------------
class ListBatch(msgspec.Struct):
    """The same batch as per-token Python lists: what a naive JSON/msgpack design would send."""

    input_ids: list[int]
    position_ids: list[int]
    loss_mask: list[bool]
    advantages: list[float]
    inference_logprobs: list[float]
    seq_lens: list[int]
    example_ids: list[int]
    rewards: list[float]


def bench_codec(tokens: int, reps: int) -> tuple[float, float]:
    batch = make_batch(tokens)
    lists = ListBatch(**{f: getattr(batch, f).tolist() for f in ListBatch.__struct_fields__})
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ListBatch)
    ours, theirs = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = decode(encode(batch), TrainBatch)
        ours.append(time.perf_counter() - t0)
        assert out.num_tokens == tokens
        t0 = time.perf_counter()
        back = dec.decode(enc.encode(lists))
        theirs.append(time.perf_counter() - t0)
        assert len(back.input_ids) == tokens
    return statistics.median(ours), statistics.median(theirs)


# -- (d) fan-out ------------------------------------------------------------------------------------
FANOUT_PROCS = 4  # reader processes (2 per core); each holds R / FANOUT_PROCS buses, one thread each
FANOUT_TOKENS = 2048  # per rank: the hand-off cost is metadata + signalling, not bytes (see (b))


def fanout_reader_main(root: str, topic: str, ranks: str, steps: int, out: str) -> None:
    """One reader process: a thread per bus; each waits for its own file of every step."""
    first, count = (int(x) for x in ranks.split(":"))
    paths = RunPaths(root)
    held: dict[str, float] = {}
    ready = threading.Barrier(count + 1)
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        role = "trainer" if topic == "rollouts" else "subscriber"
        try:
            with Bus(paths, role, rank, poll_interval=0.5) as bus:
                ready.wait()
                for step in range(steps):
                    if f"{step}:{rank}" in held:  # a newer policy already answered for this step
                        continue
                    if topic == "rollouts":
                        msg = bus.wait_batch(step, timeout=120)
                        assert msg.step == step, (msg.step, step)
                        held[f"{step}:{rank}"] = time.time()
                        continue
                    # wait_policy(step) returns the newest policy >= step (a subscriber that falls
                    # behind skips ahead, as the orchestrator does): that policy holds for every
                    # step up to its own
                    msg = bus.wait_policy(step, timeout=120)
                    assert msg.step >= step, (msg.step, step)
                    now = time.time()
                    for s in range(step, min(msg.step, steps - 1) + 1):
                        held.setdefault(f"{s}:{rank}", now)
        except BaseException as e:  # noqa: BLE001 - reported by the parent
            errors.append(e)
            ready.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(first, first + count)]
    for t in threads:
        t.start()
    ready.wait()
    print("ready", flush=True)
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    Path(out).write_text(json.dumps(held))


def start_readers(root: Path, topic: str, readers: int, steps: int) -> list[tuple[subprocess.Popen, Path]]:
    procs = min(FANOUT_PROCS, readers)
    shares = [readers // procs + (i < readers % procs) for i in range(procs)]
    started, first = [], 0
    for i, n in enumerate(shares):
        out = root / f"held_{i}.json"
        cmd = [
            sys.executable,
            __file__,
            "--fanout-reader",
            str(root),
            topic,
            f"{first}:{n}",
            str(steps),
            str(out),
        ]
        started.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True), out))
        first += n
    for proc, _ in started:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", "fan-out reader failed"
    return started


def collect(started: list[tuple[subprocess.Popen, Path]]) -> dict[tuple[int, int], float]:
    held: dict[tuple[int, int], float] = {}
    for proc, out in started:
        assert proc.wait(timeout=300) == 0, "fan-out reader failed"
        for k, v in json.loads(out.read_text()).items():
            step, rank = k.split(":")
            held[int(step), int(rank)] = v
    return held


def bench_fanout_rollouts(root: Path, readers: int, steps: int, gap: float) -> dict[str, float]:
    """Latency (own file's rename -> that reader holds it), the whole step's spread (first rename ->
    last reader holds), and hand-offs per second while the writer publishes back to back."""
    paths = RunPaths(root / f"fanout_r{readers}")
    started = start_readers(paths.root, "rollouts", readers, steps)
    batch = make_batch(FANOUT_TOKENS)
    batch.world_size = readers
    renamed: dict[tuple[int, int], float] = {}
    publish_s = []
    rng = random.Random(0)
    with Bus(paths, "orchestrator", listen=False) as writer:
        for step in range(steps):
            time.sleep(rng.uniform(0.5 * gap, 1.5 * gap))
            t0 = time.perf_counter()
            for rank in range(readers):
                batch.step, batch.rank = step, rank
                writer.publish_batch(step, rank, batch)
                renamed[step, rank] = writer.last_renamed_at
            publish_s.append((time.perf_counter() - t0) / readers)
    held = collect(started)
    lat = [held[k] - renamed[k] for k in renamed]
    spread = [max(held[s, r] for r in range(readers)) - renamed[s, 0] for s in range(steps)]
    # Throughput while a step is in flight: its R files over first rename -> last reader holding.
    return {
        "p50": pct(lat, 50),
        "p99": pct(lat, 99),
        "spread": statistics.median(spread),
        "publish": statistics.median(publish_s),
        "per_s": readers / statistics.median(spread),
        "n": len(lat),
    }


def bench_fanout_policy(root: Path, subscribers: int, steps: int, gap: float) -> dict[str, float]:
    """publish_policy rings every announced doorbell: latency from the rename to each subscriber
    holding the PolicyReady, and the writer's ring_all cost."""
    paths = RunPaths(root / f"fanout_s{subscribers}")
    started = start_readers(paths.root, "policy", subscribers, steps)
    renamed, ring_s = {}, []
    rng = random.Random(1)
    with Bus(paths, "trainer", 0, listen=False) as writer:
        for step in range(steps):
            time.sleep(rng.uniform(0.5 * gap, 1.5 * gap))
            msg = PolicyReady(step=step, transport="collective", checksum="0" * 16, num_params=1, num_bytes=2)
            writer.publish_policy(msg)
            ring_s.append(time.time() - writer.last_renamed_at)
            renamed[step] = writer.last_renamed_at
    held = collect(started)
    lat = [v - renamed[s] for (s, _), v in held.items()]
    return {"p50": pct(lat, 50), "p99": pct(lat, 99), "ring_all": statistics.median(ring_s), "n": len(lat)}


def bench_writer(root: Path, ranks: list[int], reps: int, threads: int, tokens: int) -> list[str]:
    lines = [
        f"(e) writer: publish one step of R rank files ({tokens} tokens each, durable), {reps} reps "
        f"alternating, medians; new = publish_batches ({threads} threads, one dir fsync per step)",
        f"{'R':>5}  {'old s/step':>10}  {'new s/step':>10}  {'new/old':>7}  {'old ms/file':>11}  "
        f"{'new ms/file':>11}",
    ]
    batch = make_batch(tokens, sample_len=min(tokens, 128))
    paths = RunPaths(root / "writer")
    with Bus(paths, "orchestrator", listen=False, publish_threads=threads) as writer:
        step = 0
        for r in ranks:
            rank_batches = [msgspec.structs.replace(batch, rank=i, world_size=r) for i in range(r)]
            old, new = [], []
            for _ in range(reps):
                for how in ("old", "new"):
                    step += 1
                    for b in rank_batches:
                        b.step = step
                    t0 = time.perf_counter()
                    if how == "old":
                        for b in rank_batches:
                            writer.publish_batch(step, b.rank, b)
                    else:
                        writer.publish_batches(step, rank_batches)
                    (old if how == "old" else new).append(time.perf_counter() - t0)
                    writer.cleanup(before_step=step + 1)  # the trainer's retention, off the clock
            o, n = statistics.median(old), statistics.median(new)
            lines.append(
                f"{r:>5}  {o:10.3f}  {n:10.3f}  {n / o:7.2f}  {o / r * 1e3:11.3f}  {n / r * 1e3:11.3f}"
            )
    return lines


def fanout_tables(root: Path, readers: list[int], subscribers: list[int], steps: int) -> list[str]:
    lines = [
        f"(d) rollouts fan-out: one writer, R trainer-rank buses ({FANOUT_TOKENS} tokens per rank, "
        f"{steps} steps, readers = threads in {FANOUT_PROCS} processes)",
        f"{'R':>5}  {'p50 ms':>7}  {'p99 ms':>7}  {'step spread ms':>14}  {'publish ms/file':>15}  "
        f"{'hand-offs/s':>11}  {'n':>6}",
    ]
    for r in readers:
        m = bench_fanout_rollouts(root, r, steps, gap=0.05)
        lines.append(
            f"{r:>5}  {m['p50'] * 1e3:7.2f}  {m['p99'] * 1e3:7.2f}  {m['spread'] * 1e3:14.1f}  "
            f"{m['publish'] * 1e3:15.2f}  {m['per_s']:11.0f}  {m['n']:>6}"
        )
    lines += [
        "",
        "(d) policy fan-out: publish_policy -> K doorbell subscribers (Bus.wait_policy)",
        f"{'K':>5}  {'p50 ms':>7}  {'p99 ms':>7}  {'ring_all ms':>11}  {'n':>6}",
    ]
    for k in subscribers:
        m = bench_fanout_policy(root, k, steps * 2, gap=0.05)
        lines.append(
            f"{k:>5}  {m['p50'] * 1e3:7.2f}  {m['p99'] * 1e3:7.2f}  {m['ring_all'] * 1e3:11.2f}  {m['n']:>6}"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--dir", type=Path, default=REPO / "outputs" / "bench_bus", help="scratch dir (disk under test)"
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fanout", action="store_true", help="only (d), the fan-out tables")
    ap.add_argument("--readers", default="1,16,64,256", help="(d) trainer-rank readers, comma-separated")
    ap.add_argument("--subscribers", default="1,4,16,64", help="(d) policy doorbell subscribers")
    ap.add_argument("--fanout-steps", type=int, default=10, help="(d) steps per reader count")
    ap.add_argument("--writer", action="store_true", help="only (e), the step writer old vs new")
    ap.add_argument("--writer-ranks", default="64,256,1024", help="(e) rank files per step")
    ap.add_argument("--writer-threads", type=int, default=16, help="(e) Bus(publish_threads=...)")
    ap.add_argument("--reader", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--fanout-reader", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reader:
        root, mode, count, out = args.reader
        reader_main(root, mode, int(count), out)
        return
    if args.fanout_reader:
        root, topic, ranks, steps, out = args.fanout_reader
        fanout_reader_main(root, topic, ranks, int(steps), out)
        return
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    t_start = time.time()
    if args.writer:
        ranks = [int(x) for x in args.writer_ranks.split(",")]
        print("\n".join(bench_writer(args.dir, ranks, args.reps, args.writer_threads, 256)))
        print(
            f"\n{os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}, scratch {args.dir}, "
            f"total {time.time() - t_start:.0f} s"
        )
        shutil.rmtree(args.dir, ignore_errors=True)
        return
    fanout = fanout_tables(
        args.dir,
        [int(x) for x in args.readers.split(",")],
        [int(x) for x in args.subscribers.split(",")],
        args.fanout_steps,
    )
    if args.fanout:
        print("\n".join(fanout))
        print(
            f"\n{os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}, scratch {args.dir}, "
            f"total {time.time() - t_start:.0f} s"
        )
        shutil.rmtree(args.dir, ignore_errors=True)
        return
    rows = []
    door = bench_latency(args.dir, "doorbell", 200, (0.005, 0.025), 16_384)
    poll = bench_latency(args.dir, "poll", 40, (0.15, 0.45), 16_384)
    for name, lat in (("doorbell", door), ("1 s polling", poll)):
        rows.append(
            (
                f"(a) hand-off latency, {name} (16k tokens, n={len(lat)})",
                f"p50 {pct(lat, 50) * 1e3:7.1f} ms   p99 {pct(lat, 99) * 1e3:7.1f} ms",
                "",
            )
        )
    for checksum in ("xxh3", "crc32"):
        bus_s, raw_s = bench_throughput(args.dir, 64, args.reps, checksum)
        mbps = 64 / bus_s
        rows.append(
            (
                f"(b) 64 MiB write+read, bus ({checksum}) / raw",
                f"{raw_s / bus_s:5.2f}x   bus {bus_s * 1e3:5.0f} ms ({mbps:4.0f} MiB/s)  raw {raw_s * 1e3:5.0f} ms",
                "target >= 0.8" if checksum == "xxh3" else "fallback without xxhash",
            )
        )
    ours, theirs = bench_codec(1 << 20, args.reps)
    rows.append(
        (
            "(c) encode+decode 1M tokens, lists / bus",
            f"{theirs / ours:5.0f}x   bus {ours * 1e3:5.1f} ms  lists {theirs * 1e3:6.0f} ms",
            "target >= 20",
        )
    )
    width = max(len(r[0]) for r in rows)
    vwidth = max(len(r[1]) for r in rows)
    print(f"{'measure':<{width}}  {'result (medians of ' + str(args.reps) + ' reps)':<{vwidth}}  note")
    print("-" * (width + vwidth + 25))
    for label, value, note in rows:
        print(f"{label:<{width}}  {value:<{vwidth}}  {note}")
    print()
    print("\n".join(fanout))
    print(f"\n{os.cpu_count()} cpus, scratch {args.dir}, total {time.time() - t_start:.0f} s")
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
