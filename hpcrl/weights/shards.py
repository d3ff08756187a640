"""Pieces of a policy: the rows of one Hugging Face tensor that one trainer rank holds.

A sharded publish never assembles a tensor on the trainer. Each rank yields `Piece`s: a name (HF),
the whole tensor's dtype and shape, and a run of rows [row0, row0 + rows) along dim 0 with their
bytes. FSDP2 shards every parameter along dim 0 into contiguous runs (torch.chunk), expert
parallelism hands each rank whole experts, so a rank's share of every tensor is one run of rows.
Pieces travel in buckets of bounded size (`buckets`); their digests (hpcrl.weights.checksum.rows_digest)
add up to the digest of the whole tensor, so the policy checksum needs no gather.

`local_rows` reads a DTensor's placement: Shard(0) over any mesh dims gives this rank's rows and their
global offset (torch's own `compute_local_shape_and_global_offset`); a rank that holds a replica
(Replicate on a mesh dim where it is not coordinate 0) yields nothing, so every row is sent once.
Any other layout (sharded on another dim, partial, strided) is gathered, which every rank must do
in step: the caller iterates the model in the same order on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

KEY_SEP = "#rows"  # a piece's key in a safetensors file: "<hf name>#rows<row0>"; never in an HF name


@dataclass
class Piece:
    """Rows [row0, row0 + tensor.shape[0]) of the tensor `name` whose full shape is `shape`."""

    name: str
    shape: tuple[int, ...]
    row0: int
    tensor: torch.Tensor  # this piece's rows (0-dim tensors: the whole scalar, row0 = 0)

    @property
    def rows(self) -> int:
        return self.tensor.shape[0] if self.tensor.dim() else 1

    @property
    def dtype(self) -> str:
        return str(self.tensor.dtype).removeprefix("torch.")

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def key(self) -> str:
        return f"{self.name}{KEY_SEP}{self.row0}"


def full_piece(name: str, t: torch.Tensor) -> Piece:
    return Piece(name, tuple(t.shape), 0, t)


def local_rows(t: torch.Tensor) -> tuple[torch.Tensor, int] | None | str:
    """This rank's rows of `t` and the global index of the first: (local tensor, row0); None when this
    rank sends nothing of it (a replica held by another rank too, or no rows); "gather" when the
    layout is not a run of rows (the caller gathers the full tensor, on every rank)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, DTensor):
        return (t, 0)  # a plain tensor: every rank holds all of it (the caller decides who sends)
    mesh, placements = t.device_mesh, t.placements
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    for i, p in enumerate(placements):
        if type(p) is Replicate:
            if coord[i] != 0:
                return None
        elif type(p) is not Shard or p.dim != 0:  # _StridedShard, Partial, Shard(1), ...
            return "gather"
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    if any(o for o in offset[1:]) or tuple(shape[1:]) != tuple(t.shape[1:]):
        return "gather"
    local = t.to_local()
    if local.dim() == 0 or local.shape[0] == 0:
        return None if t.dim() else (local, 0)
    assert tuple(local.shape) == tuple(shape), (local.shape, shape)
    return local, int(offset[0]) if t.dim() else 0


def buckets(pieces: Iterable[Piece], bucket_bytes: int) -> Iterator[list[Piece]]:
    """Consecutive pieces grouped into lists of at most `bucket_bytes` (a larger piece alone).
    Lazy: only the pieces of the bucket being filled are held."""
    out: list[Piece] = []
    size = 0
    for p in pieces:
        if out and size + p.nbytes > bucket_bytes:
            yield out
            out, size = [], 0
        out.append(p)
        size += p.nbytes
    if out:
        yield out


def split_rows(p: Piece, max_bytes: int) -> Iterator[Piece]:
    """A piece cut into pieces of at most `max_bytes` (whole rows; at least one row each): a 600 MB
    embedding does not become one 600 MB bucket."""
    if p.tensor.dim() == 0:
        yield p
        return
    for a, b in split_bounds(p.rows, p.nbytes // max(1, p.rows), max_bytes):
        yield Piece(p.name, p.shape, p.row0 + a, p.tensor[a:b])


def split_bounds(rows: int, row_bytes: int, max_bytes: int) -> list[tuple[int, int]]:
    """Where `split_rows` cuts `rows` rows of `row_bytes` each: [(start, end)] relative to the piece
    (a receiver computes the same cuts from the shape alone)."""
    if rows * row_bytes <= max_bytes:
        return [(0, rows)]
    step = max(1, max_bytes // max(1, row_bytes))
    return [(a, min(rows, a + step)) for a in range(0, rows, step)]
