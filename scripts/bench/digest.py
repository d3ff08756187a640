"""Benchmark the row digest (hpcrl.weights.checksum): the rowdot2 digest against the per-row xxh3-128
loop it replaced (line for line as hpcrl had it at 9b691b0, when issue 49 was filed), both in the
same run, taking turns.

    python scripts/bench/digest.py                 # ~1.5 min; the bucket case allocates 3 GiB
    python scripts/bench/digest.py --threads 1     # torch threads (the old loop is single-threaded)
    python scripts/bench/digest.py --quick         # smaller tensors, 100 experts in the bucket

Medians of --reps repetitions (old and new take turns, so load hits both alike); GB/s of raw tensor
bytes; the first line is torch._int_mm alone over the first case's bytes (the ceiling). Measured on
the shared 2-core AVX512-VNNI dev box, torch's default threads (2), 2026-11-29, load ~1:

    (torch._int_mm alone over the first case's bytes: 15.82 GB/s)
    case                                          MiB  old GB/s  new GB/s  new/old
    fp32 [N, 384]   (1.5 KiB rows)                192     1.736     13.04     7.5x
    bf16 [N, 768]   (1.5 KiB rows)                192     1.733     13.80     8.0x
    bf16 [N, 2048]  (4 KiB rows)                  256     5.070     14.29     2.8x
    bf16 [N, 8192]  (16 KiB rows)                 256     8.987     14.68     1.6x
    bf16 [N] 1-D    (2 B rows)                      1     0.005      1.04   221.3x
    bucket: 1,000 x [768, 2048] bf16 parts       3000     3.827      8.68     2.3x
    bucket: 500 x [2048] bf16 1-D parts             2     0.005      0.22    46.4x

Over ten measurements at 1.5 KiB rows (five runs, fp32 and bf16): the old loop 1.7-3.1 GB/s (its one
core runs fastest when the machine is quiet), the new digest 12.3-17.0, 5.1-8.0x, median 5.4x. The
ceiling is the box's read bandwidth (_int_mm alone 13.5-15.8 GB/s, a plain int64 sum ~16). rowdot1
(8 KiB units) gave 10.6-13.4 GB/s and 4.1-6.8x against the same old loop. The bucket row pays a
matmul call and Python per part; 1-D tensors a fixed ~0.2 ms a call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hpcrl.weights.checksum import parts_digests  # noqa: E402

# The former digest, exactly as hpcrl.weights.checksum had it at 9b691b0 (when issue 49 was filed):
# one xxh3-128 per row, seeded with its index, summed mod 2**128, each row through `_row_hash`.
try:
    import xxhash
except ImportError:  # pragma: no cover - xxhash ships with wandb
    xxhash = None


def _old_tensor_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.contiguous().view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


def _row_hash(data: memoryview, seed: int) -> int:
    if xxhash is not None:
        return xxhash.xxh3_128_intdigest(data, seed)
    import hashlib

    h = hashlib.sha256(seed.to_bytes(8, "little"))
    h.update(data)
    return int.from_bytes(h.digest()[:16], "little")


def old_rows_digest(t: torch.Tensor, row0: int = 0) -> int:
    """The former digest (`rows_digest` at 9b691b0), line for line."""
    rows = t.shape[0] if t.dim() else 1
    data = _old_tensor_bytes(t)
    if rows == 0:
        return 0
    rb = len(data) // rows
    acc = 0
    for i in range(rows):
        acc += _row_hash(data[i * rb : (i + 1) * rb], (row0 + i) % (1 << 64))
    return acc % (1 << 128)


def _random(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random bytes of the given dtype (any bit pattern, NaNs included: the digest reads bytes)."""
    n = 1
    for s in shape:
        n *= s
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(-128, 128, (nbytes,), dtype=torch.int8, generator=g)
    return raw.view(dtype).reshape(shape)


def _time(fns: list, reps: int) -> list[float]:
    """Median seconds of each fn, the fns taking turns (so load hits them alike)."""
    for fn in fns:
        fn()  # warm-up (K matrix, allocator, oneDNN kernels)
    ts: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, t in zip(fns, ts):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in ts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads (default 0: torch's own, every core)"
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="smaller tensors; 100 experts in the bucket")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    mib = 2**20
    size = (32 if args.quick else 192) * mib
    big = (64 if args.quick else 256) * mib
    experts = 100 if args.quick else 1000

    cases: list[tuple[str, list[tuple[torch.Tensor, int]]]] = [
        ("fp32 [N, 384]   (1.5 KiB rows)", [(_random((size // 1536, 384), torch.float32, g), 0)]),
        ("bf16 [N, 768]   (1.5 KiB rows)", [(_random((size // 1536, 768), torch.bfloat16, g), 0)]),
        ("bf16 [N, 2048]  (4 KiB rows)", [(_random((big // 4096, 2048), torch.bfloat16, g), 0)]),
        ("bf16 [N, 8192]  (16 KiB rows)", [(_random((big // 16384, 8192), torch.bfloat16, g), 0)]),
        ("bf16 [N] 1-D    (2 B rows)", [(_random((1 << 19,), torch.bfloat16, g), 0)]),
        (
            f"bucket: {experts:,} x [768, 2048] bf16 parts",
            [(_random((768, 2048), torch.bfloat16, g), 0) for _ in range(experts)],
        ),
        (
            "bucket: 500 x [2048] bf16 1-D parts",
            [(_random((2048,), torch.bfloat16, g), 0) for _ in range(500)],
        ),
    ]
    print(f"torch {torch.__version__}, {args.threads} thread(s), medians of {args.reps}")
    raw = cases[0][1][0][0].view(torch.int8).reshape(-1)  # the ceiling: _int_mm alone, 16 MiB blocks
    raw = raw[: raw.numel() // 7680 * 7680].view(-1, 7680)
    k8 = torch.randint(-127, 128, (7680, 8), dtype=torch.int8, generator=g)
    (t_mm,) = _time(
        [lambda: [torch._int_mm(raw[a : a + 2184], k8) for a in range(0, raw.shape[0], 2184)]], args.reps
    )
    print(f"(torch._int_mm alone over the first case's bytes: {raw.numel() / t_mm / 1e9:.2f} GB/s)")
    print(f"{'case':42s} {'MiB':>6s} {'old GB/s':>9s} {'new GB/s':>9s} {'new/old':>8s}")
    for name, parts in cases:
        nbytes = sum(t.numel() * t.element_size() for t, _ in parts)
        t_old, t_new = _time(
            [
                lambda parts=parts: [old_rows_digest(t, r) for t, r in parts],
                lambda parts=parts: parts_digests(parts),
            ],
            args.reps,
        )
        print(
            f"{name:42s} {nbytes / mib:6.0f} {nbytes / t_old / 1e9:9.3f} {nbytes / t_new / 1e9:9.2f}"
            f" {t_old / t_new:7.1f}x",
            flush=True,
        )
        del parts


if __name__ == "__main__":
    main()
