"""The policy streamed to trainer rank 0 tensor by tensor, no rank gathering it: what the checkpoint's
HF export writes (``export_hf_streamed``). The collective transport no longer goes through rank 0:
every rank broadcasts its own pieces (hpcrl.trainer.sharded_publish.publish_collective).

1. every rank casts its pieces (hpcrl.trainer.pieces: its rows, in the policy dtype) and digests them;
   the (name, dtype, shape, rows, digest) records go to every rank (``all_gather_object``: a few bytes
   per piece), so every rank knows the layout and the checksum (the same string as a full export);
2. rank 0 iterates the tensors in name order: for each it receives the other ranks' rows point to
   point (trainer group; NCCL on GPUs), copies its own, and yields the tensor; every other rank's
   iterator sends its pieces in the same order and yields nothing.
Memory: a rank's pieces (its shard in the policy dtype); rank 0 also one part (<= chunk_bytes) and
the bytes being sent (a RowSource slice), or, for the export, the tensor being written.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from hpcrl.trainer.pieces import policy_pieces
from hpcrl.weights.checksum import combine, digest_add, parts_digests, tensor_record
from hpcrl.weights.shards import Piece, split_bounds, split_rows


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


@dataclass
class Stream:
    layout: dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape), every tensor
    checksum: str
    tensors: Iterator[torch.Tensor]  # rank 0: the tensors in `names` order; other ranks: sends, yields none
    sent_bytes: int  # what this rank sends to rank 0 (0 on rank 0)

    @property
    def names(self) -> list[str]:
        return sorted(self.layout)

    @property
    def num_bytes(self) -> int:
        return sum(numel(s) * getattr(torch, d).itemsize for d, s in self.layout.values())

    @property
    def num_params(self) -> int:
        return sum(numel(s) for _, s in self.layout.values())


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def stream_to_rank0(
    model: torch.nn.Module, rank: int, dtype: str | torch.dtype | None, chunk_bytes: int = 256 * 2**20
) -> Stream:
    """Collective over trainer ranks (pieces, all_gather_object); then every rank must run its
    `tensors` to the end (rank 0 consuming, the others sending). Pieces travel to rank 0 in parts of
    at most `chunk_bytes`; rank 0's iterator yields, per tensor, the tensor itself when rank 0 holds
    all of it, else a `RowSource` (its bytes in increasing order, one part held at a time; `.full()`
    assembles the tensor)."""
    import torch.distributed as dist

    mine = sorted(policy_pieces(model, rank, dtype=dtype), key=lambda p: (p.name, p.row0))
    digests = parts_digests([(p.tensor, p.row0) for p in mine])
    records = [(p.name, p.dtype, p.shape, p.row0, p.rows, d) for p, d in zip(mine, digests)]
    everyone: list = [records]
    if world_size() > 1:
        everyone = [None] * world_size()
        dist.all_gather_object(everyone, records)
    owners: dict[str, list[tuple[int, int, int]]] = {}  # name -> [(row0, rows, rank)]
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    sums: dict[str, int] = {}
    for r, recs in enumerate(everyone):
        for name, dt, shape, row0, rows, d in recs:
            owners.setdefault(name, []).append((row0, rows, r))
            layout[name] = (dt, tuple(shape))
            sums[name] = digest_add(sums.get(name, 0), d)
    checksum = combine((n, tensor_record(n, *layout[n], sums[n])) for n in layout)
    if rank != 0:
        return Stream(layout, checksum, _send(mine, chunk_bytes), sum(p.nbytes for p in mine))
    device = mine[0].tensor.device if mine else next(model.parameters()).device
    return Stream(layout, checksum, _receive(mine, owners, layout, device, chunk_bytes), 0)


def _send(mine: list[Piece], chunk_bytes: int) -> Iterator[torch.Tensor]:
    import torch.distributed as dist

    for p in mine:  # in (name, row0) order, cut as rank 0 expects: it receives in the same order
        for q in split_rows(p, chunk_bytes):
            dist.send(q.tensor.contiguous(), dst=0)
    return
    yield  # a generator that yields nothing


def _row_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    return numel(shape[1:]) * getattr(torch, dtype).itemsize


class RowSource:
    """One tensor's bytes, made in increasing order from its pieces' parts (rank 0's own: views; the
    other ranks': received when reached). `src[a:b]` must continue where the last slice ended."""

    def __init__(
        self,
        dtype: str,
        shape: tuple[int, ...],
        parts: list[tuple[int, int, int, torch.Tensor | None]],
        device: torch.device,
    ):
        self.dtype, self.shape, self.device = getattr(torch, dtype), shape, device
        self.nbytes = numel(shape) * self.dtype.itemsize
        self._parts = iter(parts)
        self._buf: torch.Tensor | None = None
        self._at = 0  # position in _buf
        self._pos = 0  # position in the tensor's bytes

    def _next_part(self) -> None:
        import torch.distributed as dist

        _, rows, owner, t = next(self._parts)
        if t is None:
            t = torch.empty(
                (rows, *self.shape[1:]) if self.shape else (), dtype=self.dtype, device=self.device
            )
            dist.recv(t, src=owner)
        self._buf, self._at = t.contiguous().reshape(-1).view(torch.uint8), 0

    def __getitem__(self, sl: slice) -> torch.Tensor:
        a, b = sl.start or 0, sl.stop
        assert a == self._pos and b <= self.nbytes, (a, b, self._pos)
        out = []
        while b - self._pos > 0:
            if self._buf is None or self._at == self._buf.numel():
                self._next_part()
            assert self._buf is not None
            take = min(b - self._pos, self._buf.numel() - self._at)
            out.append(self._buf[self._at : self._at + take])
            self._at += take
            self._pos += take
        return out[0] if len(out) == 1 else torch.cat(out)

    def full(self) -> torch.Tensor:
        return self[0 : self.nbytes].view(self.dtype).reshape(self.shape)


def _receive(
    mine: list[Piece],
    owners: dict[str, list[tuple[int, int, int]]],
    layout: dict[str, tuple[str, tuple[int, ...]]],
    device: torch.device,
    chunk_bytes: int,
) -> Iterator[torch.Tensor | RowSource]:
    own = {(p.name, p.row0): p.tensor for p in mine}
    for name in sorted(layout):
        dtype, shape = layout[name]
        pieces = sorted(owners[name])
        if len(pieces) == 1 and pieces[0][2] == 0:
            yield own.pop((name, 0))
            continue
        parts: list[tuple[int, int, int, torch.Tensor | None]] = []
        rb = _row_bytes(dtype, shape) if shape else 0
        for row0, rows, r in pieces:
            t = own.pop((name, row0)) if r == 0 else None
            if not shape:
                parts.append((0, 1, r, t))
                continue
            for a, b in split_bounds(rows, rb, chunk_bytes):
                parts.append((row0 + a, b - a, r, None if t is None else t[a:b]))
        yield RowSource(dtype, shape, parts, device)


def export_hf_streamed(
    model: torch.nn.Module,
    tokenizer: object,
    out_dir: str,
    *,
    rank: int,
    dtype: str | torch.dtype | None = None,
    max_shard_bytes: int = 2**30,
):
    """The checkpoint's HF export without a gather: rank 0 writes the tensors as `stream_to_rank0`
    assembles them, in files of `max_shard_bytes` (the same directory `export_hf` writes, which
    resume and warm start read). Every rank must call it; every rank runs the stream to its end even
    when rank 0's write fails, so all ranks can retry it together (hpcrl.storage.retry_together)."""
    from hpcrl.trainer.model import export_hf

    st = stream_to_rank0(model, rank, dtype)
    if rank == 0:
        pairs = ((n, t if isinstance(t, torch.Tensor) else t.full()) for n, t in zip(st.names, st.tensors))
    else:
        pairs = ((None, t) for t in st.tensors)
    try:
        return export_hf(
            model,
            tokenizer,
            out_dir,
            write=rank == 0,
            dtype=dtype,
            max_shard_bytes=max_shard_bytes,
            tensors=pairs,
        )
    finally:  # a write refused on rank 0 mid-way: still receive what every other rank is sending
        deque(pairs, maxlen=0)
