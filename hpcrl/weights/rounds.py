"""The bytes of one collective weight update (protocol 4, hpcrl.weights.collective): every sender at
once, in rounds; each server takes every byte once from the network and passes it on inside; each
part verified where it lands.

Who does what in round k (`header.rounds[k]`: at most one bucket per sender, together <= bucket_bytes):
- a sender (trainer rank) sends its bucket to the round's origin in every server, all messages posted
  at once. A server's processes (vLLM: its TP workers; the hf engine: one) take turns as origins
  (`origin`: process k mod workers), so every NIC of an inference node carries 1 / tp of the policy;
- the origin posts the receives of round k from every sender at once into one round buffer (each
  sender's bucket at its own offset): all links are busy. Every other process of the server posts one
  receive of the whole round from the process before it in the server's ring (`ring`);
- when round k has landed, a process passes the round buffer on to the next one in the ring (until it
  is back at the origin's predecessor: tp - 1 hops over NVLink, loopback here), hands the parts to
  its `sink` (the engine copies them into its parameters; a vLLM worker hands whole tensors to
  load_weights) and digests the bytes the sink loaded (hpcrl.weights.checksum, on the device, one
  batched pass): that is the verification, there is no second pass.
A part of at least DIRECT (64 KiB) bytes travels as a message of its own: straight from the sender's
memory, and, in a server of one process (the hf engine), straight into its final place (the
parameter's rows: nothing is copied); the smaller parts of a bucket travel packed in one message.
Memory per receiving process: two round buffers (round k + 1 arrives while round k is loaded), each
at most one round (what lands in place needs none); nothing else here. A sender holds its current
bucket's pieces and one scratch buffer for its small parts.

Deadlock freedom: every receive a process posts for round k is matched by a send of round k, and
every wait depends only on earlier rounds: a process posts round k + 1 before it loads round k, and
reuses a round buffer (round k + 2) only once its forward of round k completed, which needs only the
next process to have posted round k; senders move to round k + 1 only after their round-k sends
completed. A peer that dies makes the others' send or receive fail (gloo: connection closed) or time
out (`timeout_s` of the group); nothing waits unbounded, and a process whose next one died goes on
taking its own rounds from the senders, so they are not left hanging.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from hpcrl.weights.collective import WeightGroup, WeightsHeader
    from hpcrl.weights.shards import Piece

ALIGN = 16  # every bucket starts at a multiple of this in a round buffer

# What a sink gets per round: (name, row0, rows of the tensor as a view of the round buffer). It may
# return the tensors to digest in the same order (the rows as they landed, e.g. in the parameters),
# or None to digest the views themselves. The views are only valid during the call.
Part = tuple[str, int, "torch.Tensor"]
Sink = Callable[[list[Part]], "list[torch.Tensor] | None"]


def dtype_of(name: str) -> torch.dtype:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in weights header")
    return dt


def part_nbytes(dtype: str, shape: list[int] | tuple[int, ...], rows: int) -> int:
    n = dtype_of(dtype).itemsize * int(rows)
    for d in list(shape)[1:]:
        n *= int(d)
    return n


def layout(recs: list[list[Any]]) -> tuple[list[int], int]:
    """Offsets of a bucket's parts (each aligned to its element size, so its bytes can be viewed as its
    dtype: at most itemsize - 1 bytes of padding per part) and the bucket's size in bytes."""
    offs, at = [], 0
    for _, dtype, shape, _, rows, _ in recs:
        size = dtype_of(dtype).itemsize
        at = -(-at // size) * size
        offs.append(at)
        at += part_nbytes(dtype, shape, rows)
    return offs, at


def _bytes(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


DIRECT = 1 << 16  # a part of at least this many bytes travels as a message of its own


def messages(recs: list[list[Any]]) -> list[list[int]]:
    """How one bucket travels (the same rule on both sides): each part of >= DIRECT bytes alone,
    straight from the sender's memory into its destination; the smaller ones packed into one message
    (aligned as `layout` says), last. Indices into `recs`."""
    big, small = [], []
    for i, (_, dtype, shape, _, rows, _) in enumerate(recs):
        (big if part_nbytes(dtype, shape, rows) >= DIRECT else small).append(i)
    return [[i] for i in big] + ([small] if small else [])


def send_bucket(group: WeightGroup, parts: list[Piece], scratch: Any, dsts: list[int], tag: int) -> int:
    """One bucket from this rank to every server head (`dsts`), every message of it posted at once
    (`messages`): a large part straight from its own memory, the small ones packed into `scratch`.
    Returns the bytes sent."""
    recs = [[p.name, p.dtype, list(p.shape), p.row0, p.rows, ""] for p in parts]
    works, sent = [], 0
    for msg in messages(recs):
        if len(msg) == 1:
            payload = _bytes(parts[msg[0]].tensor).to(group.device)
        else:
            offs, size = layout([recs[i] for i in msg])
            for i, off in zip(msg, offs):
                b = _bytes(parts[i].tensor)
                scratch[off : off + b.numel()].copy_(b)
            payload = scratch[:size]
        works += [group.pg.send([payload], dst, tag) for dst in dsts]
        sent += payload.numel() * len(dsts)
    for w in works:
        w.wait()
    return sent


def send_rounds(group: WeightGroup, header: WeightsHeader, mine: Iterable[list[Piece]]) -> None:
    """A sender's part of every round: its buckets (`mine`, lazily, in order) to every server head."""
    import torch

    from hpcrl.weights import rounds as me  # looked up per call: tests wrap send_bucket

    it: Iterator[list[Piece]] = iter(mine)
    scratch = None
    for k, rnd in enumerate(header.rounds):
        recs = next((r for src, r in rnd if src == group.rank), None)
        if recs is None:
            continue
        parts = next(it)
        if [(p.name, p.row0, p.rows) for p in parts] != [(r[0], r[3], r[4]) for r in recs]:
            raise RuntimeError(f"round {k}: this rank's pieces are not the ones the header lists")
        small = [m for m in messages(recs) if len(m) > 1]
        size = layout([recs[i] for i in small[0]])[1] if small else 0
        if size and (scratch is None or scratch.numel() < size):
            scratch = torch.empty(size, dtype=torch.uint8, device=group.device)
        heads = [origin(off, n, k) for off, n in header.servers]
        group.stats["sent_bytes"] = group.stats.get("sent_bytes", 0) + me.send_bucket(
            group, parts, scratch, heads, k
        )


def origin(first: int, workers: int, k: int) -> int:
    """The group rank of the server's process that takes round k from the trainer: the server's
    processes take turns, so every one of its NICs carries 1 / workers of the policy."""
    return first + k % workers


def _server(group: WeightGroup, header: WeightsHeader) -> tuple[int, int]:
    for off, n in header.servers:
        if off <= group.rank < off + n:
            return off, n
    raise RuntimeError(f"group rank {group.rank} belongs to no server of the weights header {header.servers}")


def ring(first: int, workers: int, me: int, k: int) -> tuple[int | None, int | None]:
    """(where round k comes from: None = the senders, where it goes next: None = nowhere) for process
    `me` of a server whose processes are ranks first .. first + workers - 1. The round goes around the
    ring from its origin (`origin`) to the process before it: workers - 1 hops inside the server."""
    o, w = origin(first, workers, k), me - first
    prev = None if me == o else first + (w - 1) % workers
    nxt = first + (w + 1) % workers
    return prev, (None if nxt == o else nxt)


def _buffers(group: WeightGroup, need: int) -> list[torch.Tensor]:
    """Two round buffers of at least `need` bytes, kept on the group: a steady-state update allocates
    nothing (and takes no page faults)."""
    import torch

    bufs = group.buffers
    if len(bufs) != 2 or bufs[0].numel() < need:
        bufs[:] = []  # free the old ones before allocating larger
        bufs[:] = [torch.empty(need, dtype=torch.uint8, device=group.device) for _ in range(2)]
    return bufs


# Where a receiving process puts a part that travels alone: its final place (e.g. the parameter's rows,
# then nothing is copied), or None for the round buffer. Only a process that forwards nothing uses it.
Dest = Callable[[str, int, int], "torch.Tensor | None"]


def _view(t: torch.Tensor, rec: list[Any]) -> torch.Tensor:
    name, dtype, shape, row0, rows, _ = rec
    return t.view(dtype_of(dtype)).reshape((int(rows), *shape[1:]) if shape else ())


def plan_round(rnd: list[Any], dest: Dest | None) -> tuple[list[tuple[int, Any, int, list[Any]]], int]:
    """How this process receives one round: per message (src, its target: a byte offset into the
    round buffer or a destination tensor, its bytes, its records), and the round buffer bytes it
    needs. Buckets start at ALIGN-aligned offsets; a follower receives the whole buffer as one."""
    out, at = [], 0
    for src, bucket in rnd:
        for msg in messages(bucket):
            recs = [bucket[i] for i in msg]
            n = layout(recs)[1]
            target = None
            if dest is not None and len(msg) == 1:
                name, dtype, _, row0, rows, _ = recs[0]
                d = dest(name, int(row0), int(rows))
                if d is not None and d.dtype == dtype_of(dtype) and d.is_contiguous():
                    target = d
            if target is None:
                at = -(-at // ALIGN) * ALIGN
                target, at = at, at + n
            out.append((int(src), target, n, recs))
    return out, at


def _landing(
    buf: torch.Tensor, plan: list[tuple[int, Any, int, list[Any]]]
) -> list[tuple[int, list[Any], Any]]:
    """Per message: (src, its records, the uint8 tensor it lands in)."""
    out = []
    for src, target, n, recs in plan:
        if isinstance(target, int):
            out.append((src, recs, buf[target : target + n]))
        else:
            out.append((src, recs, target.reshape(-1).view(torch_uint8())))
    return out


def torch_uint8() -> Any:
    import torch

    return torch.uint8


class _Round:
    """A round whose receives are posted; `land` waits for them, forwards, loads and verifies."""

    def __init__(self, k: int, msgs: list[tuple[int, list[Any], Any]], buf: torch.Tensor, works: list[Any]):
        self.k, self.msgs, self.buf, self.works = k, msgs, buf, works

    def parts(self) -> tuple[list[Part], list[list[Any]], list[int]]:
        out, recs, srcs = [], [], []
        for src, mrecs, raw in self.msgs:
            offs, _ = layout(mrecs)
            for off, rec in zip(offs, mrecs):
                n = part_nbytes(rec[1], rec[2], rec[4])
                out.append((rec[0], int(rec[3]), _view(raw[off : off + n], rec)))
                recs.append(rec)
                srcs.append(src)
        return out, recs, srcs


def receive_rounds(
    group: WeightGroup, header: WeightsHeader, sink: Sink | None, dest: Dest | None = None
) -> tuple[dict[str, int], list[str]]:
    """A receiving process's part of every round (see the module docstring). `sink` None: received,
    forwarded and dropped (a refused plan: no peer is left hanging). `dest`: where a part that travels
    alone lands (ignored on a process that forwards). Returns the digest of every tensor from what
    landed (summed over its parts) and the first bad parts (at most 3: a part whose digest differs from
    its sender's), after the last round."""
    from hpcrl.weights.checksum import digest_add, parts_digests

    first, workers = _server(group, header)
    plans = [  # a server of one process receives large parts in place; a ring keeps rounds whole
        plan_round(r, dest if (workers == 1 and sink is not None) else None) for r in header.rounds
    ]
    bufs = _buffers(group, max((size for _, size in plans), default=0) or 1)
    forwards: list[Any] = [None, None]
    digests: dict[str, int] = {}
    bad: list[str] = []
    lost: list[
        str
    ] = []  # the next worker stopped taking rounds: keep receiving (senders are not left hanging)
    dead: set[int] = set()

    def drop_next(e: Exception) -> None:
        nxt = first + (group.rank - first + 1) % workers
        if nxt not in dead:
            dead.add(nxt)
            lost.append(f"worker at group rank {nxt} stopped receiving ({str(e).splitlines()[0][:160]})")

    def forwarded(i: int) -> None:
        w, forwards[i] = forwards[i], None
        if w is None:
            return
        try:
            w.wait()
        except RuntimeError as e:  # gloo: connection closed / timeout; NCCL: the communicator aborted
            drop_next(e)

    def post(k: int) -> _Round:
        b = bufs[k % 2]
        forwarded(k % 2)  # the buffer may still travel to the next worker
        plan, size = plans[k]
        msgs = _landing(b, plan)
        prev, _ = ring(first, workers, group.rank, k)
        if prev is None:  # this round's origin: every message of every sender's bucket, all at once
            works = [group.pg.recv([raw], src, k) for src, _, raw in msgs]
            n = sum(raw.numel() for _, _, raw in msgs)
            group.stats["received_bytes"] = group.stats.get("received_bytes", 0) + n
        else:  # the whole round buffer from the process before this one in the server's ring
            works = [group.pg.recv([b[:size]], prev, k)]
            group.stats["forwarded_in_bytes"] = group.stats.get("forwarded_in_bytes", 0) + size
        return _Round(k, msgs, b[:size], works)

    def land(r: _Round) -> None:
        for w in r.works:
            w.wait()
        _, nxt = ring(first, workers, group.rank, r.k)
        if nxt is not None and nxt not in dead:
            try:
                forwards[r.k % 2] = group.pg.send([r.buf], nxt, r.k)
            except RuntimeError as e:
                drop_next(e)
        if sink is None:
            return
        parts, recs, srcs = r.parts()
        landed = sink(parts) or [v for _, _, v in parts]
        got = parts_digests([(t, row0) for t, (_, row0, _) in zip(landed, parts)])
        for d, rec, src in zip(got, recs, srcs):
            name, _, _, row0, rows, want = rec
            digests[name] = digest_add(digests.get(name, 0), d)
            if d != int(want, 16) and len(bad) < 3:
                bad.append(f"round {r.k} from sender rank {src}: {name} rows {row0}..{int(row0) + int(rows)}")

    pending: _Round | None = None
    for k in range(len(header.rounds)):
        arrival = post(k)
        if pending is not None:
            land(pending)
        pending = arrival
    if pending is not None:
        land(pending)
    forwarded(0)
    forwarded(1)
    if lost:
        raise RuntimeError(f"policy {header.step}: this server's {lost[0]}; its weights are incomplete")
    return digests, bad


class Assembler:
    """A sink that builds whole tensors from their parts on `device` and hands each complete one to
    `done(name, tensor)` (a tensor that arrives whole in one part is handed over as the view itself,
    without a copy). Holds only the tensors whose rows are still arriving."""

    def __init__(
        self, header: WeightsHeader, device: Any, done: Callable[[list[tuple[str, torch.Tensor]]], None]
    ):
        self.shapes = {n: (d, tuple(s)) for n, d, s in header.tensors}
        self.device, self.done = device, done
        self.building: dict[str, list[Any]] = {}  # name -> [tensor, rows still missing]

    def __call__(self, parts: list[Part]) -> list[torch.Tensor]:
        import torch

        complete, landed = [], []
        for name, row0, view in parts:
            dtype, shape = self.shapes[name]
            rows = shape[0] if shape else 1
            if name not in self.building and (not shape or view.shape[0] == rows):
                complete.append((name, view))
                landed.append(view)
                continue
            slot = self.building.get(name)
            if slot is None:
                slot = self.building[name] = [
                    torch.empty(shape, dtype=dtype_of(dtype), device=self.device),
                    rows,
                ]
            dst = slot[0][row0 : row0 + view.shape[0]]
            dst.copy_(view)
            landed.append(dst)
            slot[1] -= view.shape[0]
            if slot[1] == 0:
                complete.append((name, self.building.pop(name)[0]))
        if complete:
            self.done(complete)
        return landed
