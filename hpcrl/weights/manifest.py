"""A policy written as pieces by every trainer rank, with one manifest: the filesystem transport of the
sharded publish, and the reader that assembles it on a server.

Layout of broadcasts/step_N/ (or any directory):

    rank00000-00000.safetensors   rank 0's first bucket of pieces (key "<hf name>#rows<row0>")
    rank00000.json                what rank 0 wrote: one entry per piece (written after its files)
    rank00001-00000.safetensors   ...
    manifest.json                 written last, by rank 0, once every rank's entries are in:
        {"version": 1, "step": N, "checksum": "...", "num_params": P, "num_bytes": B,
         "tensors": {name: {"dtype": "bfloat16", "shape": [r, c],
                            "pieces": [[file, key, row_start, row_end, digest_hex], ...]}}}

Every file is fsynced and renamed into place; manifest.json is the last rename, so a directory without
it is a publish that did not complete (a rank killed mid-write) and is refused whole. A reader
assembles one tensor at a time from its pieces, checks each piece's dtype, shape and rows digest
against the manifest, and checks the policy checksum it recomputes against the manifest's
(hpcrl.weights.checksum: the same string a full export's `state_dict_checksum` gives).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpcrl.fileio import fsync_dir, fsync_file, tmp_name, write_atomic
from hpcrl.weights.checksum import combine, digest_sum, parts_digests, rows_digest, tensor_record
from hpcrl.weights.shards import Piece, buckets, split_rows

if TYPE_CHECKING:
    import torch

MANIFEST = "manifest.json"
VERSION = 1


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.json"


def is_sharded(path: str | os.PathLike[str]) -> bool:
    """A directory written by the sharded publish (complete or not)."""
    p = Path(path)
    return p.is_dir() and ((p / MANIFEST).exists() or any(p.glob("rank*.json")))


@dataclass
class Written:
    """What one rank wrote: its manifest entries and its bytes on disk."""

    entries: list[list[Any]] = field(default_factory=list)  # [name, dtype, shape, file, key, a, b, digest]
    nbytes: int = 0
    files: int = 0


def write_pieces(
    directory: Path, rank: int, pieces: Iterable[Piece], bucket_bytes: int, *, durable: bool = True
) -> Written:
    """Write this rank's pieces, one safetensors file per bucket, then its entries (rank file).
    Holds at most one bucket (plus the pieces the iterator has made and not yet handed over)."""

    directory.mkdir(parents=True, exist_ok=True)
    out = Written()
    cut = (q for p in pieces for q in split_rows(p, bucket_bytes))
    for k, bucket in enumerate(buckets(cut, bucket_bytes)):
        fname = f"rank{rank:05d}-{k:05d}.safetensors"
        final = directory / fname
        tmp = tmp_name(final)
        tensors = {p.key: _host(p.tensor) for p in bucket}
        _save_renamed(tensors, {"format": "pt"}, tmp, final, durable)
        digests = parts_digests([(tensors[p.key], p.row0) for p in bucket])
        for p, d in zip(bucket, digests):
            out.entries.append(
                [p.name, p.dtype, list(p.shape), fname, p.key, p.row0, p.row0 + p.rows, f"{d:032x}"]
            )
        out.nbytes += final.stat().st_size
        out.files += 1
        del tensors, bucket
    write_atomic(directory / rank_file(rank), [json.dumps(out.entries).encode()], durable=durable)
    if durable:
        fsync_dir(directory)
    return out


def write_delta(
    directory: Path, rank: int, delta: Any, pieces: list[Piece], *, durable: bool = True
) -> Written:
    """This rank's delta sync: one file (the encoded tensors, keyed by piece key, with the delta
    manifest in its metadata), then its entries (rank file) with the NEW pieces' digests."""

    from hpcrl.weights.delta import META_KEY

    directory.mkdir(parents=True, exist_ok=True)
    fname = delta_file(rank)
    final = directory / fname
    tmp = tmp_name(final)
    _save_renamed(delta.tensors, {"format": "pt", META_KEY: delta.manifest_json()}, tmp, final, durable)
    out = Written(files=1, nbytes=final.stat().st_size)
    digests = parts_digests([(p.tensor, p.row0) for p in pieces])
    for p, d in zip(pieces, digests):
        out.entries.append(
            [p.name, p.dtype, list(p.shape), fname, p.key, p.row0, p.row0 + p.rows, f"{d:032x}"]
        )
    write_atomic(directory / rank_file(rank), [json.dumps(out.entries).encode()], durable=durable)
    return out


def _save_renamed(
    tensors: dict[str, torch.Tensor], meta: dict[str, str], tmp: Path, final: Path, durable: bool
) -> None:
    """`tensors` saved to `tmp`, renamed to `final` last; a refused try leaves no tmp behind (the
    storage policy retries it from a clean start)."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(tmp), metadata=meta)
        if durable:
            fsync_file(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def delta_file(rank: int) -> str:
    return f"rank{rank:05d}.delta.safetensors"


def _host(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t if t.device.type == "cpu" else t.cpu()).contiguous()


@dataclass
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[tuple[str, str, int, int, int]]  # (file, key, row_start, row_end, digest)

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def digest(self) -> int:
        return digest_sum(p[4] for p in self.pieces)


@dataclass
class Manifest:
    step: int
    checksum: str
    tensors: dict[str, TensorEntry]
    num_params: int = 0
    num_bytes: int = 0
    # a delta sync: {"base_step", "base_checksum", "files": [one delta file per rank]}; the pieces'
    # digests are those of the new policy (hpcrl.weights.sharded_delta reads it)
    delta: dict[str, Any] | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": VERSION,
                "step": self.step,
                "checksum": self.checksum,
                "num_params": self.num_params,
                "num_bytes": self.num_bytes,
                "delta": self.delta,
                "tensors": {
                    n: {
                        "dtype": e.dtype,
                        "shape": list(e.shape),
                        "pieces": [[f, k, a, b, f"{d:032x}"] for f, k, a, b, d in e.pieces],
                    }
                    for n, e in sorted(self.tensors.items())
                },
            },
            separators=(",", ":"),
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: str) -> int:
    import torch

    dt = getattr(torch, dtype, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return dt.itemsize


def build(step: int, entries: Iterable[list[Any]]) -> Manifest:
    """The manifest of `entries` (every rank's), checked: each tensor's pieces agree on dtype and
    shape and cover its rows exactly once. ValueError (one line) otherwise."""
    tensors: dict[str, TensorEntry] = {}
    for name, dtype, shape, fname, key, a, b, digest in entries:
        shape = tuple(int(x) for x in shape)
        e = tensors.setdefault(name, TensorEntry(name, dtype, shape, []))
        if (e.dtype, e.shape) != (dtype, shape):
            raise ValueError(f"pieces of {name!r} disagree: {e.dtype}{e.shape} vs {dtype}{shape}")
        e.pieces.append((str(fname), str(key), int(a), int(b), int(str(digest), 16)))
    for e in tensors.values():
        _check_cover(e)
    m = Manifest(step, "", tensors)
    m.checksum = combine((n, tensor_record(n, e.dtype, e.shape, e.digest)) for n, e in tensors.items())
    m.num_params = sum(_numel(e.shape) for e in tensors.values())
    m.num_bytes = sum(_numel(e.shape) * _itemsize(e.dtype) for e in tensors.values())
    return m


def _check_cover(e: TensorEntry) -> None:
    e.pieces.sort(key=lambda p: p[2])
    at = 0
    for _, _, a, b, _ in e.pieces:
        if a != at or b <= a:
            what = "a gap" if a > at else "an overlap"
            raise ValueError(f"pieces of {e.name!r} leave {what} at row {at} (piece rows [{a}, {b}))")
        at = b
    if at != e.rows:
        raise ValueError(f"pieces of {e.name!r} cover rows [0, {at}) of {e.rows}: a piece is missing")


def finish(
    directory: Path, step: int, world: int, *, durable: bool = True, delta: dict[str, Any] | None = None
) -> Manifest:
    """Rank 0, after every rank wrote: merge the rank files into manifest.json (the last rename)."""
    entries: list[list[Any]] = []
    for r in range(world):
        f = directory / rank_file(r)
        if not f.is_file():
            raise ValueError(f"{f} is missing: trainer rank {r} did not finish writing policy {step}")
        entries.extend(json.loads(f.read_text()))
    m = build(step, entries)
    m.delta = delta
    write_atomic(directory / MANIFEST, [m.to_json().encode()], durable=durable)
    return m


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest of a sharded policy directory; ValueError (one line) when it is absent (the publish
    did not complete), torn or inconsistent."""
    d = Path(path)
    f = d / MANIFEST
    if not f.is_file():
        raise ValueError(f"{d} has no {MANIFEST}: the sharded publish did not complete; refused")
    try:
        raw = json.loads(f.read_text())
        if raw.get("version") != VERSION:
            raise ValueError(f"version {raw.get('version')!r} != {VERSION}")
        entries = [
            [n, t["dtype"], t["shape"], fn, k, a, b, dg]
            for n, t in raw["tensors"].items()
            for fn, k, a, b, dg in t["pieces"]
        ]
        m = build(int(raw["step"]), entries)
        m.delta = raw.get("delta")
        if m.delta is not None and not (
            isinstance(m.delta, dict)
            and isinstance(m.delta.get("files"), list)
            and "base_checksum" in m.delta
        ):
            raise ValueError("its delta entry is malformed")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{f} is corrupt: {str(e).splitlines()[0][:300]}") from None
    if m.checksum != raw.get("checksum"):
        raise ValueError(f"{f} is corrupt: its checksum does not match its pieces' digests")
    for e in m.tensors.values():
        for fname, *_ in e.pieces:
            if Path(fname).name != fname:
                raise ValueError(f"{f} is corrupt: piece file {fname!r} is not a plain name")
    return m


def assemble(
    path: str | os.PathLike[str], manifest: Manifest | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, full tensor) in sorted name order, each built from its pieces and verified
    (every piece's dtype, shape and rows digest; at the end the policy checksum). Holds one tensor
    at a time (pieces are read straight into its rows). ValueError names the first piece that is
    missing or wrong."""
    import torch

    d = Path(path)
    m = manifest if manifest is not None else read_manifest(d)
    if m.delta is not None:
        raise ValueError(f"{d} holds a delta sync, not full weights (hpcrl.weights.sharded_delta)")
    if not _SAFETENSORS_DTYPES:
        _SAFETENSORS_DTYPES.update(_dtype_codes())
    handles: dict[str, Any] = {}
    records = []
    try:
        for name in sorted(m.tensors):
            e = m.tensors[name]
            dtype = getattr(torch, e.dtype)
            out = torch.empty(e.shape, dtype=dtype)
            for fname, key, a, b, digest in e.pieces:
                dst = out[a:b] if e.shape else out
                _read_piece(d, fname, key, dst, handles)  # straight from the file into its rows
                if rows_digest(dst, a) != digest:
                    raise ValueError(f"piece {key!r} in {d / fname} does not match its digest (corrupt)")
            records.append((name, tensor_record(name, e.dtype, e.shape, e.digest)))
            yield name, out
    finally:
        for fh, _, _ in handles.values():
            fh.close()
        handles.clear()
    if combine(records) != m.checksum:  # pragma: no cover - build() already ties digests to it
        raise ValueError(f"{d}: assembled policy checksum differs from the manifest's")


def _read_piece(d: Path, fname: str, key: str, dst: torch.Tensor, handles: dict[str, Any]) -> None:
    """Read piece `key` of safetensors file `fname` into `dst` (contiguous rows of the assembled
    tensor): its header is parsed once per file, the bytes are read with one readinto, no copy."""
    import torch

    got = handles.get(fname)
    f = d / fname
    if got is None:
        if not f.is_file():
            raise ValueError(f"piece file {f} is missing; refused")
        try:
            fh = open(f, "rb")  # noqa: SIM115 - kept open while its pieces are read, closed below
            n = int.from_bytes(fh.read(8), "little")
            if not 0 < n <= 100 * 2**20:
                raise ValueError(f"header length {n}")
            header = json.loads(fh.read(n))
        except (OSError, ValueError) as e:
            raise ValueError(f"piece file {f} cannot be read: {str(e)[:200]}") from None
        for old in handles.values():
            old[0].close()
        handles.clear()  # pieces come mostly in file order: keep one open
        got = handles[fname] = (fh, 8 + n, header)
    fh, base, header = got
    meta = header.get(key)
    if not isinstance(meta, dict):
        raise ValueError(f"piece {key!r} is missing from {f}; refused")
    want_dtype = _SAFETENSORS_DTYPES.get(dst.dtype)
    start, end = (int(x) for x in meta.get("data_offsets", (0, -1)))
    nbytes = dst.numel() * dst.element_size()
    if (
        meta.get("dtype") != want_dtype
        or tuple(meta.get("shape", ())) != tuple(dst.shape)
        or end - start != nbytes
    ):
        raise ValueError(
            f"piece {key!r} in {f} is {meta.get('dtype')}{tuple(meta.get('shape', ()))}, the manifest says "
            f"{want_dtype}{tuple(dst.shape)}"
        )
    view = memoryview(dst.reshape(-1).view(torch.uint8).numpy()).cast("B") if nbytes else memoryview(b"")
    fh.seek(base + start)
    if nbytes and fh.readinto(view) != nbytes:
        raise ValueError(f"piece {key!r} in {f} is truncated; refused")


def _dtype_codes() -> dict[Any, str]:
    import torch

    return {
        torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
        torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
        torch.bool: "BOOL",
    }  # fmt: skip


_SAFETENSORS_DTYPES: dict[Any, str] = {}
