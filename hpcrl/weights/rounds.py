"""The bytes of one collective weight update (protocol 4, hpcrl.weights.collective): every sender at
once, in rounds; each server takes every byte once from the network and passes it on inside; each
part verified where it lands.

Who does what in round k (`header.rounds[k]`: at most one bucket per sender, together <= bucket_bytes):
- a sender (trainer rank r) sends its bucket to one process of every server, `holder`: worker
  r mod workers (vLLM: its TP workers; the hf engine: its one process), all messages posted at once;
  so every NIC of an inference node carries ~1 / tp of the policy and a sender talks to one process
  per server;
- each process posts the receives of its senders' buckets of round k at once into its round buffer,
  where every worker's segment has its place (all links are busy);
- when they have landed, the server's processes complete the round with a ring all-gather of the
  segments (tp - 1 steps over NVLink, loopback here: each byte crosses the network once per server),
  then each hands the parts to its `sink` (the engine copies them into its parameters; a vLLM worker
  hands whole tensors to load_weights) and digests the bytes the sink loaded (hpcrl.weights.checksum,
  on the device, one batched pass): that is the verification, there is no second pass.
A part of at least DIRECT (64 KiB) bytes travels as a message of its own: straight from the sender's
memory, and, in a server of one process (the hf engine), straight into its final place (the
parameter's rows: nothing is copied); the smaller parts of a bucket travel packed in one message.
Memory per receiving process: two round buffers (round k + 1 arrives while round k is loaded), each
at most one round (what lands in place needs none); nothing else here. A sender holds its current
bucket's pieces and one scratch buffer for its small parts.

Deadlock freedom: every receive a process posts for round k is matched by a send of round k, and
every wait depends only on round k or earlier: a process posts round k + 1 from its senders before it
completes and loads round k; the ring steps of round k are posted send and receive together, and each
step's segment is one its process already holds; senders move to round k + 1 only once their round-k
sends completed. A peer that dies makes the others' send or receive fail (gloo: connection closed)
or time out (`timeout_s` of the group); nothing waits unbounded, and a process whose ring broke goes
on taking its own senders' buckets, so they are not left hanging, and fails the update at the end.
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
        heads = [holder(off, n, group.rank) for off, n in header.servers]
        group.stats["sent_bytes"] = group.stats.get("sent_bytes", 0) + me.send_bucket(
            group, parts, scratch, heads, k
        )


def holder(first: int, workers: int, src: int) -> int:
    """The group rank of the server's process that takes sender `src`'s buckets from the network: the
    senders are spread over the server's processes (src mod workers), so every NIC of an inference
    node carries about 1 / workers of the policy and a sender talks to one process per server."""
    return first + src % workers


def _server(group: WeightGroup, header: WeightsHeader) -> tuple[int, int]:
    for off, n in header.servers:
        if off <= group.rank < off + n:
            return off, n
    raise RuntimeError(f"group rank {group.rank} belongs to no server of the weights header {header.servers}")


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


Msg = tuple[int, Any, int, list[Any], int]  # src, target (buffer offset or tensor), bytes, records, segment


def plan_round(rnd: list[Any], workers: int, dest: Dest | None) -> tuple[list[Msg], list[tuple[int, int]]]:
    """How a process of a server of `workers` processes receives one round: per message (src, target:
    a byte offset into the round buffer or a destination tensor, bytes, records, the segment = the
    process that takes it from the network), and each segment's [start, end) in the round buffer. The
    buffer holds the segments in process order, each bucket ALIGN-aligned, so the processes can pass
    whole segments around the server's ring."""
    out: list[Msg] = []
    bounds, at = [], 0
    for w in range(workers):
        start = at = -(-at // ALIGN) * ALIGN
        for src, bucket in rnd:
            if int(src) % workers != w:
                continue
            at = -(-at // ALIGN) * ALIGN
            for msg in messages(bucket):
                recs = [bucket[i] for i in msg]
                n = layout(recs)[1]
                target: Any = None
                if dest is not None and len(msg) == 1:
                    name, dtype, _, row0, rows, _ = recs[0]
                    d = dest(name, int(row0), int(rows))
                    if d is not None and d.dtype == dtype_of(dtype) and d.is_contiguous():
                        target = d
                if target is None:
                    at = -(-at // ALIGN) * ALIGN
                    target, at = at, at + n
                out.append((int(src), target, n, recs, w))
        bounds.append((start, at))
    return out, bounds


def _landing(buf: torch.Tensor, plan: list[Msg]) -> list[tuple[int, list[Any], Any, int]]:
    """Per message: (src, its records, the uint8 tensor it lands in, its segment)."""
    import torch

    out = []
    for src, target, n, recs, w in plan:
        if isinstance(target, int):
            out.append((src, recs, buf[target : target + n], w))
        else:
            out.append((src, recs, target.reshape(-1).view(torch.uint8), w))
    return out


class _Round:
    """A round whose receives from the senders are posted; `land` waits for them, completes the round
    around the server's ring, loads and verifies."""

    def __init__(
        self, k: int, msgs: list[Any], buf: torch.Tensor, bounds: list[tuple[int, int]], works: list[Any]
    ):
        self.k, self.msgs, self.buf, self.bounds, self.works = k, msgs, buf, bounds, works

    def parts(self) -> tuple[list[Part], list[list[Any]], list[int]]:
        out, recs, srcs = [], [], []
        for src, mrecs, raw, _ in self.msgs:
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
    passed on and dropped (a refused plan: no peer is left hanging). `dest`: where a part that travels
    alone lands (a server of one process only). Returns the digest of every tensor from what landed
    (summed over its parts) and the first bad parts (at most 3: a part whose digest differs from its
    sender's), after the last round."""
    from hpcrl.weights.checksum import digest_add, parts_digests

    first, workers = _server(group, header)
    me = group.rank - first
    plans = [
        plan_round(r, workers, dest if (workers == 1 and sink is not None) else None) for r in header.rounds
    ]
    bufs = _buffers(group, max((b[-1][1] for _, b in plans), default=0) or 1)
    digests: dict[str, int] = {}
    bad: list[str] = []
    lost: list[str] = []  # the ring broke: keep taking this process's own buckets (no sender hangs)

    def post(k: int) -> _Round:
        plan, bounds = plans[k]
        msgs = _landing(bufs[k % 2], plan)
        mine = [(src, raw) for src, _, raw, w in msgs if w == me]
        works = [group.pg.recv([raw], src, k) for src, raw in mine]
        group.stats["received_bytes"] = group.stats.get("received_bytes", 0) + sum(r.numel() for _, r in mine)
        return _Round(k, msgs, bufs[k % 2], bounds, works)

    def around(r: _Round) -> None:
        """The ring all-gather of round k's segments: in step j process w passes on segment w - j + 1
        and takes segment w - j from the process before it; workers - 1 steps."""
        nxt, prev = first + (me + 1) % workers, first + (me - 1) % workers
        for j in range(1, workers):
            out_seg, in_seg = (me - j + 1) % workers, (me - j) % workers
            (a, b), (c, d) = r.bounds[out_seg], r.bounds[in_seg]
            tag = r.k * 1024 + j
            try:
                ops = ([group.pg.send([r.buf[a:b]], nxt, tag)] if b > a else []) + (
                    [group.pg.recv([r.buf[c:d]], prev, tag)] if d > c else []
                )
                for op in ops:
                    op.wait()
            except RuntimeError as e:  # gloo: connection closed / timeout; NCCL: the communicator aborted
                lost.append(
                    f"ring step {j} of round {r.k} with group ranks {prev}/{nxt}: {str(e).splitlines()[0][:160]}"
                )
                return
            group.stats["forwarded_in_bytes"] = group.stats.get("forwarded_in_bytes", 0) + (d - c)

    def land(r: _Round) -> None:
        for w in r.works:
            w.wait()
        if lost:  # the ring broke earlier: this process takes its own buckets and nothing else
            return
        around(r)
        if sink is None or lost:
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
