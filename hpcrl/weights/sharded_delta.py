"""Delta sync of a sharded publish: each trainer rank encodes its own pieces against its own previous
pieces (hpcrl.weights.delta, keyed by piece key "<name>#rows<row0>"), and a server turns the ranks'
deltas into one delta over whole Hugging Face tensors, which both backends apply as before.

Per tensor: every piece "same" -> "same"; every piece "dense" -> "dense" (the rows concatenated);
otherwise "sparse" over the whole tensor: each piece's changed positions (a dense piece: all of them)
shifted by its first element (row0 x elements per row), re-blocked by 65,536 elements. Exact: the
values are the new bits, as in a one-process delta. The checksum a server computes after applying
it covers the full result, compared with the announced one (the pieces' digests).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from hpcrl.weights.delta import BLOCK, SEP, Delta, read_delta_file, sparse_positions
from hpcrl.weights.manifest import Manifest, read_manifest

if TYPE_CHECKING:
    import torch


def read_sharded_delta(path: str, manifest: Manifest | None = None) -> Delta | None:
    """The whole-tensor delta of a sharded delta sync under `path`; None for full weights. ValueError
    (one line) for a missing manifest or delta file, or pieces that disagree with it."""
    d = Path(path)
    m = manifest if manifest is not None else read_manifest(d)
    if m.delta is None:
        return None
    parts: dict[str, Delta] = {}
    for fname in m.delta["files"]:
        f = d / str(fname)
        if Path(str(fname)).name != fname or not f.is_file():
            raise ValueError(f"delta file {f} is missing; refused")
        parts[str(fname)] = read_delta_file(str(f))
    return merge(m, parts)


def merge(m: Manifest, parts: dict[str, Delta]) -> Delta:
    import torch

    layout: dict[str, tuple[str, tuple[int, ...], str]] = {}
    out: dict[str, torch.Tensor] = {}
    for name in sorted(m.tensors):
        e = m.tensors[name]
        shape = e.shape
        row = 1
        for x in shape[1:]:
            row *= x
        kinds, pos, vals = [], [], []
        for fname, key, a, b, _ in e.pieces:
            part = parts.get(fname)
            if part is None or key not in part.layout:
                raise ValueError(f"piece {key!r} is not in delta file {fname!r}; refused")
            dtype, pshape, kind = part.layout[key]
            if dtype != e.dtype or tuple(pshape) != ((b - a, *shape[1:]) if shape else ()):
                raise ValueError(f"delta piece {key!r} is {dtype}{tuple(pshape)}, the manifest disagrees")
            kinds.append(kind)
            off = a * row
            if kind == "dense":
                t = part.tensors[key].reshape(-1)
                pos.append(torch.arange(off, off + t.numel(), dtype=torch.int64))
                vals.append(t)
            elif kind == "sparse":
                c, i = part.tensors[f"{key}{SEP}counts"], part.tensors[f"{key}{SEP}index"]
                pos.append(sparse_positions(c, i) + off)
                vals.append(part.tensors[f"{key}{SEP}values"])
        if all(k == "same" for k in kinds):
            layout[name] = (e.dtype, shape, "same")
        elif all(k == "dense" for k in kinds):
            layout[name] = (e.dtype, shape, "dense")
            out[name] = torch.cat(vals).reshape(shape)
        else:
            p, v = torch.cat(pos), torch.cat(vals)
            n = 1
            for x in shape:
                n *= x
            low = p & 0xFFFF
            layout[name] = (e.dtype, shape, "sparse")
            out[f"{name}{SEP}counts"] = torch.bincount(p >> 16, minlength=-(-n // BLOCK)).to(torch.int32)
            out[f"{name}{SEP}index"] = torch.where(low >= 1 << 15, low - BLOCK, low).to(torch.int16)
            out[f"{name}{SEP}values"] = v
    delta = Delta(int(m.delta["base_step"]), str(m.delta["base_checksum"]), layout, out)
    delta.check()
    return delta
