"""The rowdot2 row digest (hpcrl.weights.checksum): the vectorised torch code against a plain reference
of its definition (Python ints mod 2**64, numpy for K), additivity over any cut, every single flipped
bit caught, swaps and renames caught, and the _int_mm and float64 paths giving the same integers."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from hpcrl.weights import checksum as ck
from hpcrl.weights.checksum import (
    ALGO,
    digest_add,
    digest_sum,
    parts_digests,
    rows_digest,
    state_dict_checksum,
)

M64 = (1 << 64) - 1


def _splitmix(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _k_table(n: int) -> np.ndarray:
    """K[:n] as the docstring defines it, with numpy uint64 (independent of the torch code)."""
    x = np.arange(n * 8, dtype=np.uint64) + np.uint64(1 << 63)
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    h = (z >> np.uint64(32)).astype(np.int64)
    lane = np.tile(np.arange(8), n)
    mag = np.where((lane == 0) | (lane == 4), 2 * (h % 64) + 1, h % 127 + 1)
    return np.where((z & np.uint64(1)).astype(bool), -mag, mag).reshape(n, 8)


def _c() -> list[int]:
    out = []
    for lane in range(8):
        z = _splitmix(0xC000000000000000 + lane)
        out.append(z | 1 if lane in (0, 4) else z & (M64 - 1))
    return out


def reference(t: torch.Tensor, row0: int = 0) -> int:
    """The definition, row by row: each row's units (its slot of a packed unit, or its segments)."""
    t = t.detach().cpu().contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    rows = t.shape[0]
    if rows == 0 or t.numel() == 0:
        return 0
    fresh = torch.empty(t.shape, dtype=t.dtype).copy_(t)  # standard strides
    raw = fresh.reshape(-1).view(torch.int8).reshape(rows, -1).numpy().astype(np.int64)
    nbytes = raw.shape[1]
    seg, unit = ck.SEG, ck.UNIT
    if nbytes > seg:
        g_rows, segs = 1, -(-nbytes // seg)
    else:
        a = 8 // math.gcd(nbytes, 8)
        g_rows, segs = max(1, unit // nbytes // a * a), 1
    k = _k_table(min(seg, g_rows * nbytes))
    c = _c()
    lo = hi = 0
    for r in range(rows):
        g = row0 + r
        for s in range(segs):
            part = raw[r, s * seg : (s + 1) * seg]
            off = (g % g_rows) * nbytes
            d = [int(x) for x in part @ k[off : off + len(part)]]
            m = _splitmix((g // g_rows) * 2**16 + s) | 1
            lo += m * sum(c[i] * d[i] for i in range(4))
            hi += m * sum(c[i] * d[i] for i in range(4, 8))
    return (lo & M64) | (hi & M64) << 64


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.randint(-128, 128, (n,), dtype=torch.int8, generator=g).view(dtype).reshape(shape)


@pytest.fixture
def tiny_units(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small units and segments, so that packing, partial units and segments show on small tensors."""
    monkeypatch.setattr(ck, "UNIT", 64)
    monkeypatch.setattr(ck, "SEG", 96)


def _paths(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    if path == "int_mm":  # every block through _int_mm, no piece too small for its own
        monkeypatch.setattr(ck, "SMALL_BYTES", 0)
        monkeypatch.setattr(ck, "DIRECT_BYTES", 0)
    else:  # everything through the float64 path
        monkeypatch.setattr(ck, "SMALL_BYTES", 1 << 40)


def test_constants_match_the_definition() -> None:
    assert _splitmix(0) == 0xE220A8397B1DCDAF  # splitmix64's first output for seed 0
    assert list(ck.C) == _c() and ck.C[0] % 2 == ck.C[4] % 2 == 1
    k = _k_table(ck.SEG)
    assert (k != 0).all() and (np.abs(k) <= 127).all() and (k[:, [0, 4]] % 2 == 1).all()
    assert torch.equal(ck._kmats(torch.device("cpu"))[0], torch.from_numpy(k).to(torch.int8))
    assert ck.layout(2) == (16384, 1) and ck.layout(1536) == (21, 1) and ck.layout(6) == (5460, 1)
    assert ck.layout(8191) == (1, 1) and ck.layout(ck.SEG) == (1, 1) and ck.layout(ck.SEG + 1) == (1, 2)


CASES = [
    ((), torch.float32),
    ((7,), torch.bfloat16),
    ((300,), torch.uint8),
    ((5, 7), torch.bfloat16),  # 14 B rows: not a multiple of 8
    ((40, 30), torch.float16),
    ((9, 3), torch.int64),
    ((4, 3, 5), torch.uint8),  # 15 B rows
    ((6, 2, 4), torch.float32),
]


@pytest.mark.parametrize("path", ["int_mm", "float64"])
@pytest.mark.parametrize("row0", [0, 5])
def test_digest_is_the_definition(monkeypatch: pytest.MonkeyPatch, path: str, row0: int) -> None:
    _paths(monkeypatch, path)
    for i, (shape, dtype) in enumerate(CASES):
        t = _rand(shape, dtype, i)
        assert rows_digest(t, row0) == reference(t, row0), (shape, dtype)


@pytest.mark.parametrize("path", ["int_mm", "float64"])
def test_packed_partial_units_and_segments(
    monkeypatch: pytest.MonkeyPatch, tiny_units: None, path: str
) -> None:
    """UNIT 64 / SEG 96: rows of 2..14 B packed (partial first/last units at any row0), rows of
    100-300 B cut into segments (a short last one, or none), non-contiguous input."""
    _paths(monkeypatch, path)
    for i, (shape, dtype) in enumerate(
        [*CASES, ((5, 50), torch.float32), ((4, 48), torch.float32), ((3, 25), torch.bfloat16)]
    ):
        t = _rand(shape, dtype, i)
        for row0 in (0, 3, 64):
            assert rows_digest(t, row0) == reference(t, row0), (shape, dtype, row0)
    t = _rand((30, 70), torch.float32, 9)
    assert rows_digest(t.t(), 2) == reference(t.t(), 2)  # 120 B rows, not contiguous


def test_views_with_any_strides() -> None:
    t = _rand((4, 6), torch.float32, 13)
    for v in (t.t(), t.t()[2:3], t[:, 1:2], t[1:2, 2:3].t(), t.t()[::2], t[1], t[1][::2], t[2, 3]):
        assert rows_digest(v, 1) == reference(v, 1), (tuple(v.shape), v.stride())


def test_a_row_longer_than_a_segment() -> None:
    t = _rand((2, 35_001), torch.int16, 3)  # 70,002 B rows: a full segment and a short one
    assert rows_digest(t, 7) == reference(t, 7)


def test_int_mm_and_float64_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    parts = [(_rand((64, 384), torch.float32, 1), 0), (_rand((2048,), torch.bfloat16, 2), 100)]
    parts += [(_rand((33, 70_000), torch.uint8, 3), 1), (_rand((3, 1000), torch.bfloat16, 4).t(), 9)]
    _paths(monkeypatch, "float64")
    slow = parts_digests(parts)
    _paths(monkeypatch, "int_mm")
    calls = []
    int_mm = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(a.shape) or int_mm(a, b))
    assert parts_digests(parts) == slow
    assert calls and all(m > 16 and k % 8 == 0 for m, k in calls)  # CUDA's constraints, here too
    monkeypatch.undo()
    assert parts_digests(parts) == slow  # the default mix of both


@pytest.mark.parametrize("units", ["default", "tiny"])
def test_digests_add_up_over_any_cut(monkeypatch: pytest.MonkeyPatch, units: str) -> None:
    if units == "tiny":
        monkeypatch.setattr(ck, "UNIT", 64)
        monkeypatch.setattr(ck, "SEG", 96)
    rng = random.Random(0)
    for shape, dtype in [((1000, 6), torch.bfloat16), ((5000,), torch.bfloat16), ((50, 30), torch.float32)]:
        t = _rand(shape, dtype, 1)
        whole = rows_digest(t)
        cuts = sorted({0, t.shape[0], *(rng.randrange(t.shape[0]) for _ in range(5))})
        pieces = [(t[a:b], a) for a, b in zip(cuts, cuts[1:])]
        assert digest_sum(rows_digest(p, a) for p, a in pieces) == whole
        assert digest_sum(parts_digests(pieces)) == whole
    # a bucket of mixed parts (row lengths, dtypes, cut points) gives each part its own digest
    a, b, c = (
        _rand((100, 16), torch.bfloat16, 4),
        _rand((64,), torch.float32, 5),
        _rand((3, 40), torch.uint8, 6),
    )
    bucket = [(a[:37], 0), (b[10:], 10), (a[37:], 37), (c, 0), (b[:10], 0), (torch.tensor(1.5), 0)]
    got = parts_digests(bucket)
    assert got == [rows_digest(p, r) for p, r in bucket]
    assert digest_add(got[0], got[2]) == rows_digest(a) and digest_add(got[1], got[4]) == rows_digest(b)
    assert parts_digests([(t, 0) for t in (a, a, a)]) == [rows_digest(a)] * 3
    assert rows_digest(torch.empty(0, 4)) == 0 and rows_digest(torch.empty(3, 0)) == 0


def test_digests_add_lane_wise() -> None:
    top = M64 | M64 << 64
    assert digest_add(top, 1) == M64 << 64  # the low lane wraps, no carry into the high one
    assert digest_add(1 << 64, top) == M64  # and the high lane wraps on its own
    assert digest_sum([top, top, 2 | 3 << 64]) == (0 | 1 << 64)
    assert digest_sum([]) == 0


def test_every_single_flipped_bit_is_caught() -> None:
    t = _rand((3, 20), torch.bfloat16, 7)  # 120 B: 960 bits, all flipped one at a time in one batch
    raw = t.view(torch.uint8).reshape(-1)
    flipped = []
    for bit in range(raw.numel() * 8):
        r = raw.clone()
        r[bit // 8] ^= 1 << (bit % 8)
        flipped.append((r.view(torch.bfloat16).reshape(3, 20), 0))
    whole = rows_digest(t)
    got = parts_digests(flipped)
    lo, hi = whole & M64, whole >> 64
    assert all(d & M64 != lo and d >> 64 != hi for d in got)  # both lanes change, every time
    big = _rand((512, 1024), torch.bfloat16, 8)  # 1 MiB through _int_mm
    whole = rows_digest(big)
    rng = random.Random(1)
    flat = big.view(torch.uint8).reshape(-1)
    for _ in range(8):
        i, b = rng.randrange(flat.numel()), rng.randrange(8)
        flat[i] ^= 1 << b
        assert rows_digest(big) != whole
        flat[i] ^= 1 << b
    assert rows_digest(big) == whole


def test_swaps_renames_retypes_and_reshapes_are_caught() -> None:
    t = _rand((64, 48), torch.bfloat16, 9)  # 96 B rows: 84 rows to a unit, all 64 in one unit
    whole = rows_digest(t)
    for i, j in [(0, 1), (3, 40), (62, 63)]:
        perm = list(range(64))
        perm[i], perm[j] = j, i
        assert rows_digest(t[perm]) != whole
    long = _rand((4, 20_000), torch.float32, 10)  # 80 kB rows: segments
    assert rows_digest(long[[1, 0, 2, 3]]) != rows_digest(long)
    assert rows_digest(t[1:4], 0) != rows_digest(t[1:4], 1)  # a row's place is part of its digest
    u, v = _rand((8, 8), torch.float32, 11), _rand((8, 8), torch.float32, 12)
    ck_uv = state_dict_checksum({"u": u, "v": v})
    assert ck_uv.startswith(ALGO + ":") and ALGO.startswith("rowdot2-") and len(ck_uv) == len(ALGO) + 33
    assert ck_uv == state_dict_checksum([("v", v.clone()), ("u", u.clone())])  # order-independent
    assert ck_uv != state_dict_checksum({"u": v, "v": u})  # swapped between names
    assert ck_uv != state_dict_checksum({"u2": u, "v": v})  # renamed
    assert ck_uv != state_dict_checksum({"u": u.view(torch.int32), "v": v})  # re-typed, same bytes
    assert ck_uv != state_dict_checksum({"u": u.reshape(4, 16), "v": v})  # reshaped, same bytes


def test_cuda_gives_the_cpu_integers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run where a GPU is: the same integers from cuBLAS's _int_mm, CUDA's int64 ops and index_add_."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    shapes = [((), torch.float32), ((300,), torch.bfloat16), ((768, 2048), torch.bfloat16)]
    shapes += [((33, 70_000), torch.uint8), ((5, 7), torch.bfloat16), ((3000, 384), torch.float32)]
    parts = [(_rand(s, d, i), 3 * i) for i, (s, d) in enumerate(shapes)]
    parts += [(parts[5][0][1:2000:2], 1), (parts[2][0][7:500].t(), 0)]  # strided, transposed
    parts += [
        (t[a:b], a) for t in (_rand((3000, 6), torch.bfloat16, 9),) for a, b in ((0, 1001), (1001, 3000))
    ]
    cpu = parts_digests(parts)
    assert parts_digests([(t.cuda(), r) for t, r in parts]) == cpu
    _paths(monkeypatch, "int_mm")
    assert parts_digests([(t.cuda(), r) for t, r in parts]) == cpu
    assert [reference(t, r) for t, r in parts[:2]] == cpu[:2]
