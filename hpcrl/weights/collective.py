"""Weight broadcast over a torch.distributed group between the trainer and inference servers.

The group is made between independently started processes (every trainer rank and every server
rank) from a TCPStore that trainer rank 0 hosts: a raw ProcessGroupGloo (CPU) or ProcessGroupNCCL
(GPU) on a PrefixStore, so it never touches the trainer's default (FSDP) process group. Group ranks
0..T-1 are the T trainer ranks (the senders), then the receivers (hpcrl.weights.rendezvous).

Wire protocol (version 3; one update):

1. broadcast from group rank 0: header length, an int64 tensor of shape [1];
2. broadcast from group rank 0: the header, a uint8 tensor holding UTF-8 JSON
   {"version": 3, "senders": T, "step": N, "bucket_bytes": B, "checksum": str | null,
    "delta": manifest | null, "adapter": peft adapter config | null,
    "tensors": [[hf_name, dtype, shape], ...],
    "buckets": [[src, [[hf_name, dtype, shape, row0, rows, digest], ...]], ...]};
   with "adapter" the tensors are a LoRA adapter's (peft names, what adapter_model.safetensors holds)
   and the receiver merges them onto its base weights instead of replacing the weights;
3. the buckets, in the header's order: bucket k goes from group rank `src` to every receiver (group
   ranks `senders`..world-1), point to point (send/recv, tag k): the raw bytes of its parts (each a
   run of whole rows of one tensor), concatenated; at most B bytes. Every trainer rank sends its own
   pieces (`src` = its group rank); no rank holds, forwards or even sees another trainer rank's rows;
   a bucket with one part goes straight from / into the tensor's own rows.

`digest` is the part's row digest (hpcrl.weights.checksum.rows_digest, 32 hex digits): a receiver
checks every part as its bucket arrives and refuses the update (CorruptBucket, naming the bucket, its
sender and the part) without loading anything; the digests add up to the policy checksum.
Names are Hugging Face parameter names (what `save_pretrained` writes), so the receiver loads them
like a safetensors file. No pickle anywhere: the header is JSON and the payload raw bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from hpcrl.weights.shards import Piece

PROTOCOL_VERSION = 3  # 3: every trainer rank sends its own pieces, each verified on receipt
DEFAULT_BUCKET_MB = 128
_PREFIX = "hpcrl-weights"


@dataclass
class WeightGroup:
    """A process group used only for weight broadcast (ranks 0..T-1: the trainer ranks)."""

    pg: Any
    rank: int
    world_size: int
    backend: str
    device: Any  # torch.device the payload lives on (cpu for gloo, cuda for nccl)
    store: Any = field(repr=False)  # keep the store alive as long as the group
    senders: int = 1  # group ranks 0..senders-1 are the trainer ranks


@dataclass
class WeightsHeader:
    step: int
    bucket_bytes: int
    checksum: str | None
    tensors: list[tuple[str, str, tuple[int, ...]]]
    delta: dict[str, Any] | None = None  # hpcrl.weights.delta manifest: the tensors encode a delta
    adapter: dict[str, Any] | None = None  # LoRA: the adapter's peft config; the tensors are its weights
    buckets: list[Any] | None = None  # [[src, [[name, dtype, shape, row0, rows, digest], ...]], ...]
    senders: int = 1  # group ranks 0..senders-1 send; the others receive every bucket

    @property
    def total_bytes(self) -> int:
        return sum(_nbytes(dtype, shape) for _, dtype, shape in self.tensors)


def init_group(
    host: str,
    port: int,
    world_size: int,
    rank: int,
    *,
    backend: str | None = None,
    timeout_s: float = 300.0,
    join_timeout_s: float | None = None,
    senders: int = 1,
) -> WeightGroup:
    """Join (rank 0: host) the weight-broadcast group. Blocks until all `world_size` ranks joined.

    `timeout_s` bounds each collective; `join_timeout_s` (default: the same) the store rendezvous,
    after which the store keeps `timeout_s` (NCCL reads it again at the first collective)."""
    import torch
    import torch.distributed as dist

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    if backend is None:
        from hpcrl.runtime import use_cuda

        backend = "nccl" if use_cuda() else "gloo"
    timeout = timedelta(seconds=timeout_s)
    join = timedelta(seconds=timeout_s if join_timeout_s is None else join_timeout_s)
    store = dist.TCPStore(host, port, world_size, is_master=(rank == 0), timeout=join, wait_for_workers=False)
    prefixed = dist.PrefixStore(_PREFIX, store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        iface = os.environ.get("GLOO_SOCKET_IFNAME")
        # Same rule as init_process_group: an explicit interface wins, else the hostname's address.
        opts._devices = [
            dist.ProcessGroupGloo.create_device(interface=iface)
            if iface
            else dist.ProcessGroupGloo.create_default_device()
        ]
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
        device = torch.device("cpu")
    elif backend == "nccl":  # pragma: no cover - no GPU here
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        raise ValueError(f"unknown weight broadcast backend {backend!r}; allowed: gloo, nccl")
    store.set_timeout(timeout)
    return WeightGroup(
        pg=pg, rank=rank, world_size=world_size, backend=backend, device=device, store=store, senders=senders
    )


def destroy_group(group: WeightGroup) -> None:
    """Release the group's communicators (best effort)."""
    shutdown = getattr(group.pg, "shutdown", None)
    if shutdown is not None:
        try:
            shutdown()
        except Exception:  # noqa: BLE001 - tearing down; nothing useful to do with the error
            pass


def _broadcast(group: WeightGroup, tensor: torch.Tensor, src: int) -> None:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    group.pg.broadcast([tensor], opts).wait()


def _dtype(name: str) -> torch.dtype:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in weights header")
    return dt


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = _dtype(dtype).itemsize
    for d in shape:
        n *= d
    return n


def _bytes(t: torch.Tensor) -> torch.Tensor:
    import torch

    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _rows(t: torch.Tensor, row0: int, rows: int) -> torch.Tensor:
    """Rows [row0, row0 + rows) of `t` as a view (a 0-dim tensor is one row)."""
    return t.reshape(1) if t.dim() == 0 else t[row0 : row0 + rows]


class CorruptBucket(ValueError):
    """A received bucket's bytes do not hash to what its sender hashed (or the pieces do not add up to
    the announced policy): nothing received may be served."""


def plan_buckets(pieces: Iterable[Piece], bucket_bytes: int) -> list[list[Piece]]:
    """A sender's pieces cut into parts of at most `bucket_bytes` (whole rows), grouped into buckets
    of at most `bucket_bytes` (a part with one row larger than that goes alone)."""
    from hpcrl.weights.shards import buckets, split_rows

    parts = (q for p in pieces for q in split_rows(p, bucket_bytes))
    return list(buckets(parts, bucket_bytes))


def bucket_records(bkts: list[list[Piece]]) -> list[list[list[Any]]]:
    """What the header says of a sender's buckets: per part [name, dtype, shape, row0, rows, digest]
    (digest: hpcrl.weights.checksum.rows_digest of the part's rows, 32 hex digits)."""
    from hpcrl.weights.checksum import rows_digest

    return [
        [[p.name, p.dtype, list(p.shape), p.row0, p.rows, f"{rows_digest(p.tensor, p.row0):032x}"] for p in b]
        for b in bkts
    ]


def schedule(per_sender: list[list[list[list[Any]]]]) -> list[list[Any]]:
    """The order the buckets travel in: round robin over the senders (group ranks 0..T-1), bucket k of
    every sender before bucket k + 1 of any. Under FSDP every rank holds the same share of each
    tensor, so bucket k of each rank covers about the same tensors and a tensor is complete soon after
    its first rows arrive. [[src, records of one bucket], ...]."""
    out = []
    for k in range(max((len(b) for b in per_sender), default=0)):
        for src, b in enumerate(per_sender):
            if k < len(b):
                out.append([src, b[k]])
    return out


def layout_and_checksum(sched: list[list[Any]]) -> tuple[list[tuple[str, str, tuple[int, ...]]], str]:
    """The tensors (name order) and the policy checksum the schedule's digests add up to (the same string
    as `state_dict_checksum` of the assembled tensors). ValueError when the pieces do not cover every
    tensor's rows exactly once."""
    from hpcrl.weights.checksum import MOD, combine, tensor_record

    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    digests: dict[str, int] = {}
    runs: dict[str, list[tuple[int, int]]] = {}
    for _, recs in sched:
        for name, dtype, shape, row0, rows, digest in recs:
            shape = tuple(int(x) for x in shape)
            if layout.setdefault(name, (dtype, shape)) != (dtype, shape):
                raise ValueError(f"tensor {name!r}: pieces disagree on dtype/shape")
            digests[name] = (digests.get(name, 0) + int(digest, 16)) % MOD
            runs.setdefault(name, []).append((int(row0), int(rows)))
    for name, (_, shape) in layout.items():
        want, at = (shape[0] if shape else 1), 0
        for row0, rows in sorted(runs[name]):
            if row0 != at:
                raise ValueError(
                    f"tensor {name!r}: rows {at}..{row0} are {'missing' if row0 > at else 'sent twice'}"
                )
            at += rows
        if at != want:
            raise ValueError(f"tensor {name!r}: pieces cover {at} of {want} rows")
    names = sorted(layout)
    checksum = combine((n, tensor_record(n, *layout[n], digests[n])) for n in names)
    return [(n, *layout[n]) for n in names], checksum


def send_header(group: WeightGroup, header: dict[str, Any]) -> None:
    """Group rank 0: the JSON header (length, then bytes)."""
    import torch

    raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(group.device)
    _broadcast(group, torch.tensor([raw.numel()], dtype=torch.int64, device=group.device), 0)
    _broadcast(group, raw, 0)


def make_header(
    step: int,
    bucket_bytes: int,
    checksum: str | None,
    tensors: list[tuple[str, str, tuple[int, ...]]],
    sched: list[list[Any]],
    *,
    delta: dict[str, Any] | None = None,
    adapter: dict[str, Any] | None = None,
    senders: int = 1,
) -> dict[str, Any]:
    return {
        "version": PROTOCOL_VERSION,
        "senders": int(senders),
        "step": int(step),
        "bucket_bytes": int(bucket_bytes),
        "checksum": checksum,
        "delta": delta,
        "adapter": adapter,
        "tensors": [[n, d, list(s)] for n, d, s in tensors],
        "buckets": sched,
    }


def _send(group: WeightGroup, tensor: torch.Tensor, dsts: range, tag: int) -> None:
    works = [group.pg.send([tensor], dst, tag) for dst in dsts]
    for w in works:
        w.wait()


def _recv(group: WeightGroup, tensor: torch.Tensor, src: int, tag: int) -> None:
    group.pg.recv([tensor], src, tag).wait()


class _Arrival:
    """A bucket whose receive is posted: `land` waits for it, unpacks a packed one from its scratch
    buffer into the tensors' rows and checks every part against its sender's digest (the first 3 bad
    parts are named in `bad`). Posting bucket k+1 before landing bucket k lets its bytes arrive while
    bucket k is digested (the senders wait for a posted receive, not for the digest)."""

    def __init__(self, k: int, src: int, recs: list, views: list, packed: Any, work: Any):
        self.k, self.src, self.recs, self.views, self.packed, self.work = k, src, recs, views, packed, work

    def land(self, bad: list[str]) -> None:
        from hpcrl.weights.checksum import rows_digest

        self.work.wait()
        if self.packed is not None:
            pos = 0
            for v in self.views:
                b = _bytes(v)
                b.copy_(self.packed[pos : pos + b.numel()])
                pos += b.numel()
        for v, (name, _, _, row0, rows, digest) in zip(self.views, self.recs):
            if len(bad) < 3 and rows_digest(v, row0) != int(digest, 16):
                bad.append(f"bucket {self.k} from sender rank {self.src}: {name} rows {row0}..{row0 + rows}")


def send_bucket(
    group: WeightGroup, parts: list[Piece], scratch: torch.Tensor | None, dsts: range, tag: int
) -> None:
    """One bucket from this rank to every receiver (`dsts`), point to point: a single part straight
    from its own memory, several packed into `scratch`."""
    if len(parts) == 1:
        _send(group, _bytes(parts[0].tensor).to(group.device), dsts, tag)
        return
    assert scratch is not None
    pos = 0
    for p in parts:
        b = _bytes(p.tensor)
        scratch[pos : pos + b.numel()].copy_(b)
        pos += b.numel()
    _send(group, scratch[:pos], dsts, tag)


def run_schedule(
    group: WeightGroup,
    header: WeightsHeader,
    mine: Iterable[list[Piece]] = (),
    out: dict[str, torch.Tensor] | None = None,
) -> None:
    """Take part in every bucket of `header`'s schedule: a trainer rank (group rank < senders) sends its
    own buckets (`mine`, in order) to every receiver, point to point, and takes no part in the other
    ranks' buckets; a receiver receives each bucket from its source into `out`'s rows, verifies every
    part against its sender's digest as the bucket arrives, goes on to the end (the senders are never
    left hanging) and then raises CorruptBucket naming the first bad part; the caller's served weights
    are never touched here. `out` None on a receiver: received and dropped (a refused plan).
    Memory: `out` and two scratch buckets (double-buffered: bucket k+1 arrives while bucket k is
    digested); on a sender its pieces and one scratch bucket."""
    import torch

    sched = header.buckets or []
    sizes = [sum(_nbytes(d, tuple(s)) // max(1, (s[0] if s else 1)) * r for _, d, s, _, r, _ in recs)
             for _, recs in sched]  # fmt: skip
    sender = group.rank < header.senders
    dsts = range(header.senders, group.world_size)
    if sender:  # a scratch bucket to pack its own multi-part buckets
        need = max(
            (n for (src, recs), n in zip(sched, sizes) if src == group.rank and len(recs) > 1), default=0
        )
        scratch = [torch.empty(need, dtype=torch.uint8, device=group.device)] if need else []
    else:  # two (double-buffered) for buckets that do not go straight into one tensor's rows
        need = max(sizes, default=0)
        scratch = (
            [torch.empty(need, dtype=torch.uint8, device=group.device) for _ in range(2)] if need else []
        )
    mine = iter(mine)
    bad: list[str] = []
    pending: _Arrival | None = None  # the bucket received before this one: digested while this one arrives
    for k, ((src, recs), n) in enumerate(zip(sched, sizes)):
        if sender:
            if src != group.rank:
                continue
            parts = next(mine)
            if [(p.name, p.row0, p.rows) for p in parts] != [(r[0], r[3], r[4]) for r in recs]:
                raise RuntimeError(f"bucket {k}: this rank's pieces are not the ones the header lists")
            send_bucket(group, parts, scratch[0] if scratch else None, dsts, k)
            continue
        if out is None:
            _recv(group, scratch[0][:n], src, k)
            continue
        views = [_rows(out[name], row0, rows) for name, _, _, row0, rows, _ in recs]
        direct = len(views) == 1 and views[0].device == group.device  # straight into the tensor's rows
        buf = _bytes(views[0]) if direct else scratch[k % 2][:n]
        arrival = _Arrival(k, src, recs, views, None if direct else buf, group.pg.recv([buf], src, k))
        if pending is not None:
            pending.land(bad)
        pending = arrival
    if pending is not None:
        pending.land(bad)
    if bad:
        raise CorruptBucket(
            f"policy {header.step}: received bytes differ from what the trainer hashed in "
            f"{'; '.join(bad)} (nothing of this update is loaded)"
        )


def broadcast_weights(
    group: WeightGroup,
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    step: int,
    *,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    checksum: str | None = None,
    delta: dict[str, Any] | None = None,
    adapter: dict[str, Any] | None = None,
) -> None:
    """Group rank 0 alone sends `named_tensors` (HF names, whole tensors) as policy `step`; the other
    trainer ranks of the group, if any, run `relay` (they take the header and nothing else). With
    `delta` (a Delta manifest) the tensors are that delta's encoded tensors and `checksum` the full
    result's; with `adapter` (a JSON-able peft LoRA config) they are that adapter's tensors and
    `checksum` theirs."""
    from hpcrl.weights.shards import full_piece

    if delta is not None and adapter is not None:
        raise ValueError("a broadcast carries either a weight delta or a LoRA adapter, not both")
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    bucket = max(1, int(bucket_mb * 2**20))
    bkts = plan_buckets((full_piece(n, t.detach()) for n, t in items), bucket)
    sched = schedule([bucket_records(bkts)])
    from hpcrl.weights.checksum import dtype_name

    tensors = [(n, dtype_name(t), tuple(t.shape)) for n, t in items]
    header = make_header(
        step, bucket, checksum, tensors, sched, delta=delta, adapter=adapter, senders=group.senders
    )
    send_header(group, header)
    run_schedule(group, _parse_header(header), bkts)


def relay(group: WeightGroup) -> WeightsHeader:
    """A trainer rank that sends nothing in this update (rank 0 alone does): takes part in the header's
    broadcast, the only collective of the update it is needed in."""
    header = receive_header(group)
    run_schedule(group, header)
    return header


def _parse_header(meta: dict[str, Any]) -> WeightsHeader:
    if meta.get("version") != PROTOCOL_VERSION:
        raise ValueError(f"weights protocol version {meta.get('version')} != {PROTOCOL_VERSION}")
    return WeightsHeader(
        step=int(meta["step"]),
        bucket_bytes=int(meta["bucket_bytes"]),
        checksum=meta.get("checksum"),
        tensors=[(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in meta["tensors"]],
        delta=meta.get("delta"),
        adapter=meta.get("adapter"),
        buckets=meta["buckets"],
        senders=int(meta.get("senders", 1)),
    )


def receive_header(group: WeightGroup, *, src: int = 0) -> WeightsHeader:
    """First half of a receive: the header (step, names, dtypes, shapes, checksum, the buckets' plan)."""
    import torch

    length = torch.zeros(1, dtype=torch.int64, device=group.device)
    _broadcast(group, length, src)
    raw = torch.empty(int(length.item()), dtype=torch.uint8, device=group.device)
    _broadcast(group, raw, src)
    return _parse_header(json.loads(bytes(raw.cpu().numpy()).decode()))


def matches(header: WeightsHeader, tensors: Mapping[str, torch.Tensor] | None, device: Any = None) -> bool:
    """True when `tensors` has exactly the header's names, dtypes and shapes (in order) on `device`."""
    if tensors is None or len(tensors) != len(header.tensors):
        return False
    for (name, dtype, shape), (have, t) in zip(header.tensors, tensors.items()):
        if (
            name != have
            or str(t.dtype).removeprefix("torch.") != dtype
            or tuple(t.shape) != shape
            or (device is not None and t.device != device)
            or not t.is_contiguous()
        ):
            return False
    return True


def receive_tensors(
    group: WeightGroup,
    header: WeightsHeader,
    *,
    device: Any = None,
    into: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Second half of a receive: every sender's buckets, each verified as it arrives, assembled into
    whole tensors on `device` (default: the group's). Raises CorruptBucket (after the last bucket)
    when a part's bytes or the policy checksum differ from the senders'.

    `into` (the previous update's result, kept by the caller) is reused when it has the header's
    layout: a steady-state receive then allocates nothing and takes no page faults.
    """
    import torch

    dev = torch.device(device) if device is not None else group.device
    if matches(header, into, dev):
        out = into
    else:
        out = {
            name: torch.empty(shape, dtype=_dtype(dtype), device=dev) for name, dtype, shape in header.tensors
        }
    try:
        tensors, checksum = layout_and_checksum(header.buckets or [])
        if sorted(tensors) != sorted(header.tensors):
            raise ValueError("the pieces' tensors are not the header's")
    except ValueError as e:  # still take part in every broadcast, then refuse
        run_schedule(group, header)
        raise CorruptBucket(f"policy {header.step}: bad plan of pieces: {e}") from None
    run_schedule(group, header, out=out)
    if header.delta is None and header.checksum is not None and checksum != header.checksum:
        raise CorruptBucket(
            f"policy {header.step}: the received pieces' checksum {checksum} != the sender's {header.checksum}"
        )
    return out


def receive_weights(group: WeightGroup, *, device: Any = None) -> tuple[int, dict[str, torch.Tensor]]:
    """Receive one update sent by `broadcast_weights` or a sharded publish: (step, {hf_name: tensor})."""
    header = receive_header(group)
    return header.step, receive_tensors(group, header, device=device)
