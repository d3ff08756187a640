"""Delta weight sync: send only the elements that changed since the previous policy.

Between consecutive bf16 policies most elements keep their bits (an AdamW step of lr 1e-6 moves a
weight of 0.02 by far less than one bf16 ulp, ~1.5e-4), so the update is encoded per tensor as

- "same":   nothing (every bit equal);
- "sparse": `<name>/counts` int32 [ceil(n / 65536)]: changed elements per block of 65536,
            `<name>/index`  int16 [k]: each changed element's position inside its block (as uint16),
            `<name>/values` <dtype> [k]: its new value;
  i.e. 2 + itemsize bytes per changed element (bf16: 4 B, against 2 B per element for the full tensor);
- "dense":  `<name>`: the whole new tensor, when sparse would not be smaller.

Elements are compared as raw bits, so -0.0 / +0.0 and NaN payloads are exact. The receiver must hold
exactly the base policy (its checksum is in the manifest and is checked first); after applying, it
checksums the FULL reconstructed weights and compares with the trainer's checksum of the full new
policy, exactly as for a full sync. Pure functions on torch tensors (any device), no pickle: the
manifest is JSON (safetensors metadata or the collective header), the payload plain tensors.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

BLOCK = 1 << 16
SEP = "/"  # never part of a Hugging Face parameter name
KINDS = ("same", "sparse", "dense")
DELTA_FILE = "delta.safetensors"
META_KEY = "hpcrl_delta"
MAX_STEP = 2**62  # a policy step (as the servers' /update_weights bounds it)
MAX_DIM = 2**40  # one tensor dimension; larger is a corrupt manifest, not a model


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's raw bits as a flat integer tensor of the same item size."""
    import torch

    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().reshape(-1).contiguous().view(ints[t.element_size()])


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@dataclass
class Delta:
    """One encoded update: the base it applies to, the layout of the full result, the payload."""

    base_step: int
    base_checksum: str
    layout: dict[str, tuple[str, tuple[int, ...], str]]  # name -> (dtype, shape, kind), every tensor
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def manifest(self) -> dict[str, Any]:
        return {
            "base_step": self.base_step,
            "base_checksum": self.base_checksum,
            "layout": {n: [d, list(s), k] for n, (d, s, k) in self.layout.items()},
        }

    def manifest_json(self) -> str:
        return json.dumps(self.manifest(), separators=(",", ":"))

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any] | str, tensors: dict[str, torch.Tensor]) -> Delta:
        """Parse and check a received delta; ValueError names what is wrong."""
        m = json.loads(manifest) if isinstance(manifest, str) else manifest
        try:
            layout = {
                str(n): (str(d), tuple(int(x) for x in s), str(k)) for n, (d, s, k) in m["layout"].items()
            }
            delta = cls(int(m["base_step"]), str(m["base_checksum"]), layout, tensors)
            if not 0 <= delta.base_step <= MAX_STEP:
                raise ValueError(f"base_step must be in [0, {MAX_STEP}], got {m['base_step']!r}")
            bad = next((n for n, (_, s, _) in layout.items() if any(not 0 <= d <= MAX_DIM for d in s)), None)
            if bad is not None:
                raise ValueError(f"layout[{bad!r}] has a dimension outside [0, {MAX_DIM}]: {layout[bad][1]}")
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError) as e:  # inf -> int: Overflow
            raise ValueError(f"malformed weight delta manifest: {e}") from e
        delta.check()
        return delta

    def check(self) -> None:
        want: set[str] = set()
        for name, (dtype, shape, kind) in self.layout.items():
            if kind not in KINDS:
                raise ValueError(f"weight delta: {name!r} has kind {kind!r}; allowed: {', '.join(KINDS)}")
            numel = 1
            for d in shape:
                numel *= d
            if kind == "dense":
                t = self._get(name)
                if _dtype_name(t) != dtype or tuple(t.shape) != shape:
                    raise ValueError(
                        f"weight delta: dense {name!r} is {_dtype_name(t)}{tuple(t.shape)}, "
                        f"the manifest says {dtype}{shape}"
                    )
                want.add(name)
            elif kind == "sparse":
                counts, index, values = (self._get(f"{name}{SEP}{p}") for p in ("counts", "index", "values"))
                k = int(counts.sum()) if counts.numel() else 0
                if (
                    counts.numel() != -(-numel // BLOCK)
                    or index.numel() != k
                    or values.numel() != k
                    or _dtype_name(values) != dtype
                    or bool((counts < 0).any())
                ):
                    raise ValueError(
                        f"weight delta: sparse parts of {name!r} disagree with its shape {shape}"
                    )
                want |= {f"{name}{SEP}counts", f"{name}{SEP}index", f"{name}{SEP}values"}
        extra = set(self.tensors) - want
        if extra:
            raise ValueError(
                f"weight delta: {len(extra)} tensor(s) not in the manifest, e.g. {sorted(extra)[:3]}"
            )

    def _get(self, key: str) -> torch.Tensor:
        t = self.tensors.get(key)
        if t is None:
            raise ValueError(f"weight delta: tensor {key!r} is missing")
        return t


def encode_delta(
    prev: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], base_step: int, base_checksum: str
) -> Delta:
    """The delta that turns `prev` (policy `base_step`) into `new`; tensors are CPU copies."""
    import torch

    layout: dict[str, tuple[str, tuple[int, ...], str]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in new.items():
        dtype, shape = _dtype_name(t), tuple(t.shape)
        p = prev.get(name)
        full = t.detach().reshape(shape).contiguous().cpu()
        if p is None or p.dtype != t.dtype or tuple(p.shape) != shape:
            layout[name] = (dtype, shape, "dense")
            out[name] = full
            continue
        a, b = _bits(p).cpu(), _bits(full)
        idx = torch.nonzero(a != b).reshape(-1)
        k, n = idx.numel(), b.numel()
        nblocks = -(-n // BLOCK)
        if k == 0:
            layout[name] = (dtype, shape, "same")
        elif k * (2 + t.element_size()) + 4 * nblocks >= n * t.element_size():
            layout[name] = (dtype, shape, "dense")
            out[name] = full
        else:
            layout[name] = (dtype, shape, "sparse")
            out[f"{name}{SEP}counts"] = torch.bincount(idx >> 16, minlength=nblocks).to(torch.int32)
            low = idx & 0xFFFF
            out[f"{name}{SEP}index"] = torch.where(low >= 1 << 15, low - BLOCK, low).to(
                torch.int16
            )  # uint16 bits
            out[f"{name}{SEP}values"] = full.reshape(-1)[idx]
    return Delta(base_step, base_checksum, layout, out)


def sparse_positions(counts: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Flat int64 positions of a sparse tensor's changed elements."""
    import torch

    blocks = torch.arange(counts.numel(), device=counts.device, dtype=torch.int64) * BLOCK
    base = torch.repeat_interleave(blocks, counts.to(torch.int64))
    return base + (index.to(torch.int64) & 0xFFFF)


def apply_delta(base: MutableMapping[str, torch.Tensor], delta: Delta) -> list[str]:
    """Apply `delta` to `base` in place (tensors of any dtype that holds the values exactly, any
    device); return the names whose values changed. `base` must have every name of the layout."""
    missing = [n for n in delta.layout if n not in base]
    if missing:
        raise ValueError(
            f"weight delta names {len(missing)} tensor(s) the receiver does not hold, e.g. {missing[:3]}"
        )
    touched = []
    for name, (_, shape, kind) in delta.layout.items():
        dst = base[name]
        if tuple(dst.shape) != shape:
            raise ValueError(
                f"weight delta: {name!r} has shape {shape}, the receiver holds {tuple(dst.shape)}"
            )
        if kind == "dense":
            dst.copy_(delta.tensors[name])
        elif kind == "sparse":
            counts = delta.tensors[f"{name}{SEP}counts"].to(dst.device)
            pos = sparse_positions(counts, delta.tensors[f"{name}{SEP}index"].to(dst.device))
            if pos.numel() and int(pos.max()) >= dst.numel():
                raise ValueError(f"weight delta: an index of {name!r} is outside its {dst.numel()} elements")
            flat = dst.view(-1)  # params are contiguous; a view writes through
            flat[pos] = delta.tensors[f"{name}{SEP}values"].to(device=dst.device, dtype=dst.dtype)
        else:
            continue
        touched.append(name)
    return touched


def read_delta_dir(path: str) -> Delta | None:
    """The delta in a broadcast dir (`delta.safetensors` + its manifest), or None for a full one."""
    from pathlib import Path

    f = Path(path) / DELTA_FILE
    if not f.is_file():
        return None
    return read_delta_file(str(f))


def read_delta_file(path: str) -> Delta:
    """One delta file (tensors + its manifest in the safetensors metadata)."""
    from safetensors import safe_open

    f = path
    with safe_open(str(f), framework="pt") as fh:
        meta = fh.metadata() or {}
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 - safe_open has no __iter__
    if META_KEY not in meta:
        raise ValueError(f"{f} has no {META_KEY} manifest")
    return Delta.from_manifest(meta[META_KEY], tensors)
