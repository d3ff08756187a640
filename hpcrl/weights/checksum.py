"""One checksum of a set of named tensors, shared by the trainer (sender) and inference (receiver).

Both sides call `state_dict_checksum` on the same Hugging Face parameter names; equal strings mean the
server holds exactly the bytes the trainer published. Names, dtypes and shapes are hashed along with
the tensors' digests, so a renamed, re-typed or reshaped tensor, or two tensors of one shape swapped
between names, also change the checksum.

The checksum is computable from pieces (hpcrl.weights.shards): a tensor's digest is a sum over its
rows, so a trainer rank that holds rows [a, b) of a tensor digests only those (`rows_digest(t, a)`)
and the digests of the pieces add up (`digest_add`, `digest_sum`) to the digest of the whole tensor,
whoever holds which rows. The policy checksum is one xxh3-128 (sha256 without `xxhash`) over (name,
dtype, shape, tensor digest) in sorted name order (`combine`). So the sharded publish (every rank
digests its own rows) and a full export (one process digests everything) give the same string, and a
server assembling the pieces computes it again as it goes.

The row digest ("rowdot2"; rowdot1 was the same with UNIT = 8192): exact integer arithmetic, the same integers on every device.

- Rows: slices along dim 0 (a 0-dim tensor is one row, a 1-D tensor of n elements n rows of one
  element); row r of a piece that starts at row `row0` has global index g = row0 + r. A row's raw
  bytes (B of them) are read as int8 (signed).
- Units: rows of B <= SEG = 65536 bytes are packed G to a unit (`layout`: the most rows that fit in
  UNIT = 32768 bytes with G * B a multiple of 8, else G = 1): row g is slot g mod G of unit g // G, and
  its byte j sits at position (g mod G) * B + j of the unit. Longer rows are cut into segments
  s = 0, 1, ... of SEG bytes (the last may be shorter), each a unit of its own (G = 1, up to 2**16
  segments: rows up to 4 GiB). A unit's key is (g // G) * 2**16 + s (s = 0 for packed rows).
- d[unit, l] = sum_pos byte[pos] * K[pos, l], l < 8, with K a fixed pseudo-random int8 matrix
  [SEG, 8] (`k_entry`: +-1..127, never 0; columns 0 and 4 all odd). |byte * K| <= 128 * 127 < 2**14
  and a unit has at most 2**16 bytes, so |d| < 2**30: the int32 sums of `torch._int_mm` are exact.
- Two 64-bit lanes per unit: e_a = sum_{l<4} C_l d_l, e_b = sum_{l>=4} C_l d_l (mod 2**64), with C_0
  and C_4 odd and the other C_l even; each multiplied by the unit's odd M = splitmix64(key) | 1.
- lane_x = sum over units of M * e_x (mod 2**64); the digest is the int lane_a | lane_b << 64.
  Every row adds its own share (the other slots of its unit count as zeros), so digests of disjoint
  row ranges add up lane-wise mod 2**64 (`digest_add`, `digest_sum`; never a 128-bit `+`) to the
  digest of their union, however a tensor is cut.

Why: a single flipped bit (a byte changed by +-2**b, b <= 7) changes each lane by
M * (+-2**b) * sum_l C_l K[pos, l]; the last factor is odd (odd * odd + even terms) and M is odd, so
the change is +-2**b * odd != 0 (mod 2**64): every single-bit error is caught, in both lanes. Rows
swapped between units change a lane by (e(x) - e(y)) * (M(key2) - M(key1)), zero only by accident of
the pseudo-random multipliers; rows swapped inside a unit meet different rows of K (a row's slot is
part of the position), likewise segments. Any other change escapes only if the 8 dot products of
every unit it touches stay equal (a random change of a unit's bytes lands in the kernel of that
linear map with negligible probability) or the lanes collide mod 2**64. This is a check against
corruption and mix-ups (wrong rows, wrong tensor, torn copies), not against an adversary: it is
linear, so anyone can craft a collision.

How: everything runs on the tensor's device (no host copy of a CUDA tensor; only 8 int64 per part
come back, `.tolist()`). Units of one width go through `torch._int_mm(int8 [m, k], K[:k])` ->
int32 [m, 8] in blocks of ~BLOCK_BYTES (16 MiB), straight from the tensor's memory (a view) where it
is contiguous; CUDA's constraints (m > 16, k and n multiples of 8, contiguous) are met on every
device with zero units and zero bytes, which add nothing. As the lanes are linear in d, a part's
8 sums P_l = sum_units M * d_l (int64, wrapping) are taken on the device, CHUNK_UNITS units at a
time (the multipliers, one product, one sum or index_add_), and lane_a = sum_{l<4} C_l P_l is
finished in Python. `parts_digests` takes many parts at once (a receiver's bucket): parts with
the same row length share blocks and chunks; pieces under DIRECT_BYTES (and the partial first and
last units of a part whose rows do not start or end on a unit boundary) wait, per (offset, width),
to be concatenated into one block, so small parts cost a few torch calls each, not a matmul each. Blocks under SMALL_BYTES use an
exact float64 matmul instead (integers < 2**53). Non-contiguous tensors are made contiguous one
block at a time.

Speed (scripts/bench/digest.py, torch's default threads = both cores of the shared AVX512-VNNI dev
box; old = the per-row xxh3-128 loop this digest replaced, line for line as it was at 9b691b0, in the
same run, taking turns), 1.5 KiB rows: 12.3-17.0 GB/s against 1.7-3.1, 5.1-8.0x over ten
measurements (median 5.4x; the ratio is lowest when the machine is quiet, since the old loop's one
core then runs fastest). 4 KiB rows 12.5-15.8 against 3.2-5.2, 16 KiB rows 14.7 against 9.0, a
bucket of 1,000 [768, 2048] bf16 parts 8.7 against 3.8, 1-D tensors (packed) ~1 GB/s at 1 MiB
against 0.005 (a Python call per element). That is the machine's read bandwidth: `torch._int_mm`
alone streams the same bytes at 13.5-15.8 GB/s on both cores and a plain int64 `sum` at ~16. rowdot1
(units of 8 KiB) reached 10.6-13.4: per-unit work beside the matmul (keys, multipliers, sums) was
~15 % of its time, 4x less with units of 32 KiB. On a GPU the same code reads HBM (no host copy). The algorithm is the checksum's prefix
("rowdot2-xxh3_128:<32 hex digits>"), so two processes that disagree on it differ loudly.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

try:
    import xxhash

    _COMBINE = "xxh3_128"
except ImportError:  # pragma: no cover - xxhash ships with wandb
    xxhash = None
    _COMBINE = "sha256"

DIGEST = "rowdot2"  # the row digest's version: change it with any change to the definition above
ALGO = f"{DIGEST}-{_COMBINE}"  # the checksum's prefix

SEG = 1 << 16  # most bytes in one unit: |d| < 128 * 127 * SEG < 2**30 (int32-exact)
UNIT = 1 << 15  # rows shorter than this are packed, G of them to a unit of ~UNIT bytes (rowdot1: 1 << 13;
# 4x fewer units, so 4x less per-unit work beside the matmul: +7-18 % GB/s)
BLOCK_BYTES = 1 << 24  # bytes of units per _int_mm (16 MiB: the per-call overhead under 5%)
DIRECT_BYTES = 1 << 18  # a piece this big gets its own _int_mm; smaller ones share a block (copied)
CHUNK_UNITS = 1 << 14  # units whose multipliers and sums are taken at once
SMALL_BYTES = 1 << 16  # blocks smaller than this take the float64 path
_MIN_M = 17  # CUDA's _int_mm wants more than 16 rows (and k, n multiples of 8)

_M64 = (1 << 64) - 1
_GOLD, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_K_BASE = 1 << 63  # K[j, l] = f(splitmix64(_K_BASE + 8 j + l)): apart from the keys (< 2**63)


def splitmix64(x: int) -> int:
    """The splitmix64 finaliser of a 64-bit int (pure Python; the reference of `_mix`)."""
    z = (x + _GOLD) & _M64
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


def k_entry(j: int, lane: int) -> int:
    """K[j, lane]: a nonzero int8 in -127..127, odd in lanes 0 and 4."""
    z = splitmix64(_K_BASE + j * 8 + lane)
    h = z >> 32
    mag = 2 * (h % 64) + 1 if lane in (0, 4) else h % 127 + 1
    return -mag if z & 1 else mag


def _c(lane: int) -> int:
    z = splitmix64(0xC000000000000000 + lane)
    return z | 1 if lane in (0, 4) else z & ~1


C = tuple(_c(lane) for lane in range(8))  # the lanes' weights: C_0 and C_4 odd, the others even


def multiplier(key: int) -> int:
    """M(key): the odd multiplier of a unit, key = unit index * 2**16 + segment."""
    return splitmix64(key) | 1


def layout(nbytes: int) -> tuple[int, int]:
    """(G, S) for rows of `nbytes` bytes: G rows to a unit (rows up to SEG bytes), or S segments to a
    row (longer rows, G = 1). G * nbytes is a multiple of 8 where G > 1."""
    if nbytes > SEG:
        return 1, -(-nbytes // SEG)
    a = 8 // math.gcd(nbytes, 8)
    return max(1, UNIT // nbytes // a * a), 1


def digest_add(a: int, b: int) -> int:
    """The digest of the union of two disjoint row ranges from theirs (lane-wise, mod 2**64)."""
    return ((a + b) & _M64) | ((((a >> 64) + (b >> 64)) & _M64) << 64)


def digest_sum(digests: Iterable[int]) -> int:
    lo = hi = 0
    for d in digests:
        lo += d & _M64
        hi += d >> 64
    return (lo & _M64) | ((hi & _M64) << 64)


def _s64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _lsr(z: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 of every int64 in x (wrapping int64 arithmetic), in place."""
    z = x.add_(_s64(_GOLD))
    z = z.bitwise_xor_(_lsr(z, 30)).mul_(_s64(_MIX1))
    z = z.bitwise_xor_(_lsr(z, 27)).mul_(_s64(_MIX2))
    return z.bitwise_xor_(_lsr(z, 31))


_KMATS: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}


def _kmats(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """K as int8 [SEG, 8] (for _int_mm) and float64 (the small path), on `device`, cached."""
    import torch

    key = (str(device), SEG)
    if key not in _KMATS:
        z = _mix(torch.arange(SEG * 8, dtype=torch.int64) + _s64(_K_BASE))
        h = _lsr(z, 32)
        lane = torch.arange(8).repeat(SEG)
        odd = (lane == 0) | (lane == 4)
        mag = torch.where(odd, 2 * (h % 64) + 1, h % 127 + 1)
        k = torch.where((z & 1).bool(), -mag, mag).reshape(SEG, 8)
        _KMATS[key] = (k.to(torch.int8).to(device), k.to(torch.float64).to(device))
    return _KMATS[key]


def _dots(a: torch.Tensor, k8: torch.Tensor, k64: torch.Tensor) -> torch.Tensor:
    """d = a @ K for int8 a [m, k] whose columns sit at unit positions p0..p0 + k: k8 = K[p0:] (int8,
    at least k rounded up to 8 rows), k64 = K[p0:p0 + k] (float64). int32 [m, 8], exact either way."""
    import torch

    m, k = a.shape
    if m * k < SMALL_BYTES:
        return (a.to(torch.float64) @ k64).to(torch.int32)  # integers < 2**30: exact in float64
    kp = -(-k // 8) * 8
    misaligned = a.device.type != "cpu" and a.data_ptr() % 16  # cuBLASLt: an aligned A
    if kp != k or m < _MIN_M or not a.is_contiguous() or misaligned:  # CUDA's constraints, kept
        p = a.new_zeros(max(m, _MIN_M), kp)  # everywhere: zero units and bytes add nothing
        p[:m, :k] = a
        a = p
    return torch._int_mm(a, k8[:kp])[:m]


class _Stream:
    """Units of one width (G packed rows, a row's full segments, or its last short segment) of the
    parts of one row length: through `_dots` a block at a time (big pieces straight from their
    memory; small ones and partial units batched by offset and width); per part, acc += the sum of
    M(key) * d over its units, CHUNK_UNITS units at a time."""

    def __init__(self, acc: torch.Tensor, width: int, per_row: int, s0: int):
        self.acc, self.width, self.per_row, self.s0 = acc, width, per_row, s0
        self.kp = kp = -(-width // 8) * 8
        self.k8, self.k64 = _kmats(acc.device)
        self.block = min(CHUNK_UNITS, max(_MIN_M, BLOCK_BYTES // kp))  # units per _dots
        self.direct = min(self.block, max(_MIN_M, -(-DIRECT_BYTES // kp)))
        # (offset, width) -> pieces waiting to be batched, their metas, their units
        self.pending: dict[
            tuple[int, int], tuple[list[torch.Tensor], list[tuple[int, int, int]], list[int]]
        ] = {}
        self.waiting = 0  # units in `pending`
        self.dots: list[torch.Tensor] = []
        self.meta: list[list[int]] = []  # [part index, key rows, first key row], in unit order
        self.units = 0

    def add(self, a: torch.Tensor, idx: int, g0: int, off: int = 0) -> None:
        """Units of part `idx`, int8 [n, w] (per_row of them to a key row, from key row g0), their
        bytes at positions off..off + w of the unit (w < width: a partial unit, the rest zeros)."""
        n, w = a.shape
        if n >= self.direct and w == self.kp and a.is_contiguous():
            self._add_dots(_dots(a, self.k8, self.k64[:w]), [(idx, n // self.per_row, g0)])
            return
        pieces, metas, units = self.pending.setdefault((off, w), ([], [], [0]))
        pieces.append(a)
        metas.append((idx, n // self.per_row, g0))
        units[0] += n
        self.waiting += n
        if units[0] >= self.block:
            self._run((off, w))
        elif self.waiting >= 4 * self.block:  # many classes (offsets) waiting: bound what they hold
            for key in list(self.pending):
                self._run(key)

    def _run(self, key: tuple[int, int]) -> None:
        import torch

        off, w = key
        pieces, metas, units = self.pending.pop(key)
        self.waiting -= units[0]
        a = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        k8 = self.k8[off:]
        if off and k8.device.type != "cpu":
            k8 = k8[: -(-w // 8) * 8].clone()  # cuBLASLt: K from an aligned allocation
        self._add_dots(_dots(a, k8, self.k64[off : off + w]), metas)

    def _add_dots(self, d: torch.Tensor, metas: list[tuple[int, int, int]]) -> None:
        if self.units + d.shape[0] > CHUNK_UNITS:
            self._reduce()
        self.dots.append(d)
        for idx, rows, g0 in metas:
            last = self.meta[-1] if self.meta else None
            if last is not None and last[0] == idx and last[2] + last[1] == g0:
                last[1] += rows
            else:
                self.meta.append([idx, rows, g0])
        self.units += d.shape[0]

    def finish(self) -> None:
        for key in list(self.pending):
            self._run(key)
        self._reduce()

    def _reduce(self) -> None:
        """acc[part] += sum over its units of M(key) * d (int64, wrapping)."""
        import torch

        if not self.dots:
            return
        d = self.dots[0] if len(self.dots) == 1 else torch.cat(self.dots)
        dev, per, meta = d.device, self.per_row, self.meta
        rows = d.shape[0] // per
        if len(meta) == 1:
            g = torch.arange(meta[0][2], meta[0][2] + rows, dtype=torch.int64, device=dev)
        else:
            counts, shift, at = [], [], 0
            for _, n, g0 in meta:
                counts.append(n)
                shift.append(g0 - at)
                at += n
            rep = torch.tensor(counts, dtype=torch.int64, device=dev)
            g = torch.arange(rows, dtype=torch.int64, device=dev)
            g += torch.repeat_interleave(torch.tensor(shift, device=dev), rep, output_size=rows)
        x = g.mul_(1 << 16)  # key = key row * 2**16 + segment
        if per > 1:
            x = (x.unsqueeze(1) + torch.arange(self.s0, self.s0 + per, device=dev)).reshape(-1)
        elif self.s0:
            x += self.s0
        w = d * _mix(x).bitwise_or_(1).unsqueeze(1)  # int64 [units, 8]
        if per > 1:
            w = w.view(rows, per, 8).sum(1)
        if len(meta) == 1:
            self.acc[meta[0][0]] += w.sum(0)
        else:
            ids = torch.tensor([e[0] for e in meta], dtype=torch.int64, device=dev)
            self.acc.index_add_(0, torch.repeat_interleave(ids, rep, output_size=rows), w)
        self.dots, self.meta, self.units = [], [], 0


def _flat_bytes(x: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor, int8 [nbytes] (a view)."""
    import torch

    f = x.reshape(-1)
    if f.stride(0) != 1:  # one element: size-1 dims may have any stride
        f = f.as_strided((f.numel(),), (1,))
    return f.view(torch.int8)


def _row_bytes(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows [a, b) of t (dim >= 1) as int8 [b - a, row bytes]; a copy only when t is not contiguous."""
    x = t[a:b]
    return _flat_bytes(x if x.is_contiguous() else x.contiguous()).view(b - a, -1)


def parts_digests(parts: Sequence[tuple[torch.Tensor, int]]) -> list[int]:
    """The digest of every (rows, row0) part: rows [row0, row0 + len(rows)) of some tensor, given those
    rows. Ints in [0, 2**128); digests of disjoint row ranges of one tensor add (`digest_add`) to the
    digest of their union. Computed on each tensor's device, the parts of one row length together."""
    import torch

    groups: dict[tuple[Any, int], list[tuple[int, torch.Tensor, int]]] = {}
    for i, (t, row0) in enumerate(parts):
        t = t.detach()
        if t.dim() == 0:
            t = t.reshape(1)
        rows = t.shape[0]
        if rows == 0 or t.numel() == 0:
            continue
        nbytes = t.numel() // rows * t.element_size()
        if nbytes > SEG << 16 or row0 < 0 or row0 + rows > 1 << 47:
            raise ValueError(f"rows_digest: rows of {nbytes} B at row {row0} are out of its range")
        groups.setdefault((t.device, nbytes), []).append((i, t, int(row0)))
    accs: dict[Any, torch.Tensor] = {}
    for (dev, nbytes), items in groups.items():
        if dev not in accs:
            accs[dev] = torch.zeros(len(parts), 8, dtype=torch.int64, device=dev)
        _digest_group(accs[dev], nbytes, items)
    out = [0] * len(parts)
    for acc in accs.values():
        for i, p in enumerate(acc.tolist()):
            if any(p):
                out[i] = _lanes(p)
    return out


def _digest_group(acc: torch.Tensor, nbytes: int, items: list[tuple[int, torch.Tensor, int]]) -> None:

    g_rows, segs = layout(nbytes)
    if segs == 1:  # units of G rows; a part's first and last units may be partial
        w = g_rows * nbytes
        st = _Stream(acc, w, 1, 0)
        for i, t, row0 in items:
            rows, end = t.shape[0], row0 + t.shape[0]
            flat = _flat_bytes(t) if t.is_contiguous() else None

            def span(a: int, b: int, t: torch.Tensor = t, flat: Any = flat) -> torch.Tensor:
                """Rows a..b of the part, int8 [1, bytes] (a copy only when t is not contiguous)."""
                x = flat[a * nbytes : b * nbytes] if flat is not None else _row_bytes(t, a, b)
                return x.view(1, -1)

            h = min(end, -(-row0 // g_rows) * g_rows)
            tl = max(h, end // g_rows * g_rows)
            if h > row0:
                st.add(span(0, h - row0), i, row0 // g_rows, row0 % g_rows * nbytes)
            for u in range(h, tl, st.block * g_rows):
                e = min(tl, u + st.block * g_rows)
                st.add(span(u - row0, e - row0).view(-1, w), i, u // g_rows)
            if end > tl:
                st.add(span(tl - row0, rows), i, tl // g_rows)
        st.finish()
        return
    full, tail = divmod(nbytes, SEG)  # rows of S segments: SEG bytes each, the last one may be short
    main = _Stream(acc, SEG, full, 0)
    last = _Stream(acc, tail, 1, full) if tail else None
    step = max(1, main.block // full)  # rows per block
    for i, t, row0 in items:
        rows = t.shape[0]
        whole = _row_bytes(t, 0, rows) if t.is_contiguous() else None
        for a in range(0, rows, step):
            b = min(rows, a + step)
            v = whole[a:b] if whole is not None else _row_bytes(t, a, b)
            main.add(v[:, : full * SEG].reshape(-1, SEG), i, row0 + a)
            if last is not None:
                last.add(v[:, full * SEG :], i, row0 + a)
    main.finish()
    if last is not None:
        last.finish()


def _lanes(p: list[int]) -> int:
    lo = sum(c * x for c, x in zip(C[:4], p[:4])) & _M64
    hi = sum(c * x for c, x in zip(C[4:], p[4:])) & _M64
    return lo | hi << 64


def rows_digest(t: torch.Tensor, row0: int = 0) -> int:
    """Digest of rows [row0, row0 + len(t)) of a tensor, given those rows (`t`): an int in [0, 2**128).
    Digests of disjoint row ranges add (`digest_add`) to the digest of their union."""
    return parts_digests([(t, row0)])[0]


def tensor_record(name: str, dtype: str, shape: tuple[int, ...], digest: int) -> bytes:
    """What the policy checksum hashes per tensor."""
    return f"{name}\0{dtype}\0{tuple(shape)}\n".encode() + digest.to_bytes(16, "little")


def combine(records: Iterable[tuple[str, bytes]]) -> str:
    """The policy checksum from (name, tensor_record) pairs, in any order."""
    items = sorted(records, key=lambda kv: kv[0])
    h = xxhash.xxh3_128() if xxhash is not None else hashlib.sha256()
    prev = None
    for name, rec in items:
        if name == prev:
            raise ValueError(f"duplicate tensor name {name!r} in checksum input")
        prev = name
        h.update(rec)
    return f"{ALGO}:{h.hexdigest()}"


def state_dict_checksum(
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> str:
    """Checksum over (name, dtype, shape, rows digest) of every tensor, in sorted name order.

    Order-independent in the input; the result looks like "rowdot2-xxh3_128:<32 hex digits>"."""
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    digests = parts_digests([(t, 0) for _, t in items])
    return combine(
        (name, tensor_record(name, dtype_name(t), tuple(t.shape), d)) for (name, t), d in zip(items, digests)
    )


def dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def payload_bytes(named_tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of a weight payload as sent: the one definition behind the `weights/sync_bytes` metric."""
    return sum(t.numel() * t.element_size() for t in named_tensors.values())
