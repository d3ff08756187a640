"""Weight broadcast over a torch.distributed group between the trainer and inference servers.

The group is made between independently started processes (every trainer rank and every server
rank) from a TCPStore that trainer rank 0 hosts: a raw ProcessGroupGloo (CPU) or ProcessGroupNCCL
(GPU) on a PrefixStore, so it never touches the trainer's default (FSDP) process group. Group ranks
0..T-1 are the T trainer ranks (the senders), then the receivers (hpcrl.weights.rendezvous).

Wire protocol (version 4; one update):

1. broadcast from group rank 0: header length, an int64 tensor of shape [1];
2. broadcast from group rank 0: the header, a uint8 tensor holding UTF-8 JSON
   {"version": 4, "senders": T, "step": N, "bucket_bytes": C, "checksum": str | null,
    "delta": manifest | null, "adapter": peft adapter config | null,
    "tensors": [[hf_name, dtype, shape], ...],
    "servers": [[first group rank, receiving processes], ...],
    "rounds": [[[src, [[hf_name, dtype, shape, row0, rows, digest], ...]], ...], ...]};
   with "adapter" the tensors are a LoRA adapter's (peft names, what adapter_model.safetensors holds)
   and the receiver merges them onto its base weights instead of replacing the weights;
3. the rounds (hpcrl.weights.rounds): in round k every sender r that has a bucket k sends it, point to
   point, to worker r mod workers of each server, all at once; the server's processes then complete
   the round with a ring all-gather. A bucket is its parts' raw bytes (each a run of whole rows of one
   tensor, aligned to its element size; parts of >= 64 KiB as messages of their own, the smaller ones
   packed into one), at most C / T bytes; a round at most C. Every trainer rank sends its own pieces;
   no rank holds, forwards or even sees another trainer rank's rows.

`digest` is the part's row digest (hpcrl.weights.checksum.rows_digest, 32 hex digits): every receiving
process digests every part where it landed and, after the last round, refuses the update
(CorruptBucket, naming the round, its sender and the part) when one differs; the digests add up to the
policy checksum, so there is no second pass. Names are Hugging Face parameter names (what
`save_pretrained` writes), so the receiver loads them like a safetensors file. No pickle anywhere: the
header is JSON and the payload raw bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from hpcrl.weights.rounds import Dest, Sink
    from hpcrl.weights.shards import Piece

PROTOCOL_VERSION = 4  # 4: rounds, all senders at once, one receiver per server fanning out inside
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
    servers: tuple[tuple[int, int], ...] = ()  # (first group rank, processes) per server; () = one each
    buffers: list[Any] = field(default_factory=list, repr=False)  # a receiver's two round buffers
    stats: dict[str, int] = field(default_factory=dict)  # bytes sent / received / forwarded, cumulative

    def server_ranks(self) -> tuple[tuple[int, int], ...]:
        return self.servers or tuple((r, 1) for r in range(self.senders, self.world_size))


@dataclass
class WeightsHeader:
    step: int
    bucket_bytes: int
    checksum: str | None
    tensors: list[tuple[str, str, tuple[int, ...]]]
    delta: dict[str, Any] | None = None  # hpcrl.weights.delta manifest: the tensors encode a delta
    adapter: dict[str, Any] | None = None  # LoRA: the adapter's peft config; the tensors are its weights
    rounds: list[Any] = field(default_factory=list)  # [[[src, [[name, dtype, shape, row0, rows, digest]]]]]
    senders: int = 1  # group ranks 0..senders-1 send
    servers: list[tuple[int, int]] = field(default_factory=list)  # (first group rank, processes)

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
    servers: tuple[tuple[int, int], ...] = (),
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
        pg=pg,
        rank=rank,
        world_size=world_size,
        backend=backend,
        device=device,
        store=store,
        senders=senders,
        servers=tuple(servers),
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


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    from hpcrl.weights.rounds import dtype_of

    n = dtype_of(dtype).itemsize
    for d in shape:
        n *= d
    return n


class CorruptBucket(ValueError):
    """A received part's bytes do not hash to what its sender hashed (or the pieces do not add up to
    the announced policy): the update must not be served."""


def iter_buckets(pieces: Iterable[Piece], bucket_bytes: int) -> Iterator[list[Piece]]:
    """A sender's pieces cut into parts of at most `bucket_bytes` (whole rows), grouped into buckets
    of at most `bucket_bytes` (a part with one row larger than that goes alone), lazily: only the
    current piece and bucket are held (a piece is cast when the iterator reaches it)."""
    from hpcrl.weights.shards import buckets, split_rows

    parts = (q for p in pieces for q in split_rows(p, bucket_bytes))
    return buckets(parts, bucket_bytes)


def plan_buckets(pieces: Iterable[Piece], bucket_bytes: int) -> list[list[Piece]]:
    return list(iter_buckets(pieces, bucket_bytes))


def bucket_record(b: list[Piece]) -> list[list[Any]]:
    """What the header says of one bucket: per part [name, dtype, shape, row0, rows, digest]
    (digest: hpcrl.weights.checksum.rows_digest of the part's rows, 32 hex digits; one batched pass
    on the device where the rows are)."""
    from hpcrl.weights.checksum import parts_digests

    digests = parts_digests([(p.tensor, p.row0) for p in b])
    return [[p.name, p.dtype, list(p.shape), p.row0, p.rows, f"{d:032x}"] for p, d in zip(b, digests)]


def bucket_records(bkts: Iterable[list[Piece]]) -> list[list[list[Any]]]:
    return [bucket_record(b) for b in bkts]


def schedule(per_sender: list[list[list[list[Any]]]]) -> list[list[Any]]:
    """The rounds: round k holds bucket k of every sender that has one, [[src, records], ...]. Under
    FSDP every rank holds the same share of each tensor, so the buckets of a round cover about the
    same tensors and a tensor is complete soon after its first rows arrive."""
    return [
        [[src, b[k]] for src, b in enumerate(per_sender) if k < len(b)]
        for k in range(max((len(b) for b in per_sender), default=0))
    ]


def layout_and_checksum(rounds: list[list[Any]]) -> tuple[list[tuple[str, str, tuple[int, ...]]], str]:
    """The tensors (name order) and the policy checksum the rounds' digests add up to (the same string
    as `state_dict_checksum` of the assembled tensors). ValueError when the pieces do not cover every
    tensor's rows exactly once."""
    from hpcrl.weights.checksum import combine, digest_add, tensor_record

    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    digests: dict[str, int] = {}
    runs: dict[str, list[tuple[int, int]]] = {}
    for rnd in rounds:
        for _, recs in rnd:
            for name, dtype, shape, row0, rows, digest in recs:
                shape = tuple(int(x) for x in shape)
                if layout.setdefault(name, (dtype, shape)) != (dtype, shape):
                    raise ValueError(f"tensor {name!r}: pieces disagree on dtype/shape")
                digests[name] = digest_add(digests.get(name, 0), int(digest, 16))
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


def checksum_of(header: WeightsHeader, digests: dict[str, int]) -> str:
    """The policy checksum from per-tensor digests (what a receiver computed from what landed)."""
    from hpcrl.weights.checksum import combine, tensor_record

    return combine((n, tensor_record(n, d, s, digests.get(n, 0))) for n, d, s in header.tensors)


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
    rounds: list[list[Any]],
    *,
    delta: dict[str, Any] | None = None,
    adapter: dict[str, Any] | None = None,
    senders: int = 1,
    servers: Iterable[tuple[int, int]] = (),
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
        "servers": [[int(a), int(b)] for a, b in servers],
        "rounds": rounds,
    }


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
    `checksum` theirs. Full weights without `checksum`: the header's is computed from the parts'
    digests (the same string as `state_dict_checksum`)."""
    from hpcrl.weights.checksum import dtype_name
    from hpcrl.weights.shards import full_piece

    if delta is not None and adapter is not None:
        raise ValueError("a broadcast carries either a weight delta or a LoRA adapter, not both")
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    bucket = max(1, int(bucket_mb * 2**20))
    bkts = plan_buckets((full_piece(n, t.detach()) for n, t in items), bucket)
    rounds = schedule([bucket_records(bkts)])
    if checksum is None and delta is None and adapter is None:  # from the digests: no second pass
        checksum = layout_and_checksum(rounds)[1]
    tensors = [(n, dtype_name(t), tuple(t.shape)) for n, t in items]
    header = make_header(
        step, bucket, checksum, tensors, rounds, delta=delta, adapter=adapter, senders=group.senders,
        servers=group.server_ranks(),
    )  # fmt: skip
    send_header(group, header)
    from hpcrl.weights.rounds import send_rounds

    send_rounds(group, _parse_header(header), bkts)


def relay(group: WeightGroup) -> WeightsHeader:
    """A trainer rank that sends nothing in this update (rank 0 alone does): takes part in the header's
    broadcast, the only collective of the update it is needed in."""
    return receive_header(group)


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
        rounds=meta["rounds"],
        senders=int(meta.get("senders", 1)),
        servers=[(int(a), int(b)) for a, b in meta["servers"]],
    )


def receive_header(group: WeightGroup, *, src: int = 0) -> WeightsHeader:
    """First half of a receive: the header (step, names, dtypes, shapes, checksum, the rounds' plan)."""
    import torch

    length = torch.zeros(1, dtype=torch.int64, device=group.device)
    _broadcast(group, length, src)
    raw = torch.empty(int(length.item()), dtype=torch.uint8, device=group.device)
    _broadcast(group, raw, src)
    return _parse_header(json.loads(bytes(raw.cpu().numpy()).decode()))


def receive_into(group: WeightGroup, header: WeightsHeader, sink: Sink, dest: Dest | None = None) -> str:
    """Second half of a receive: every round (hpcrl.weights.rounds), each part handed to `sink` and
    verified where it landed. Returns the policy checksum of what landed; raises CorruptBucket (after
    the last round: no peer is left hanging) when the plan is bad, a part differs from its sender's
    digest, or the parts do not add up to the sender's checksum. `dest`: where a large part may land
    directly (hpcrl.weights.rounds.Dest)."""
    from hpcrl.weights.rounds import receive_rounds

    try:
        tensors, checksum = layout_and_checksum(header.rounds)
        if sorted(tensors) != sorted(header.tensors):
            raise ValueError("the pieces' tensors are not the header's")
    except ValueError as e:  # still take part in every round, then refuse
        receive_rounds(group, header, None)
        raise CorruptBucket(f"policy {header.step}: bad plan of pieces: {e}") from None
    digests, bad = receive_rounds(group, header, sink, dest)
    if bad:
        raise CorruptBucket(
            f"policy {header.step}: received bytes differ from what the trainer hashed in {'; '.join(bad)}"
        )
    if header.delta is None and header.checksum is not None and checksum != header.checksum:
        raise CorruptBucket(
            f"policy {header.step}: the received pieces' checksum {checksum} != the sender's {header.checksum}"
        )
    return checksum_of(header, digests)


def receive_tensors(
    group: WeightGroup, header: WeightsHeader, *, device: Any = None
) -> dict[str, torch.Tensor]:
    """Every round assembled into whole tensors on `device` (default: the group's): for what is small
    (a LoRA adapter, a delta) or must be whole. Raises CorruptBucket like `receive_into`."""
    import torch

    from hpcrl.weights.rounds import Assembler

    out: dict[str, torch.Tensor] = {}

    def keep(done: list[tuple[str, torch.Tensor]]) -> None:
        # a tensor that came whole is a view of a round buffer, which a later round overwrites
        shared = {b.untyped_storage().data_ptr() for b in group.buffers}
        out.update((n, t.clone() if t.untyped_storage().data_ptr() in shared else t) for n, t in done)

    dev = torch.device(device) if device is not None else group.device
    receive_into(group, header, Assembler(header, dev, keep))
    return {n: out[n] for n, _, _ in header.tensors}


def receive_weights(group: WeightGroup, *, device: Any = None) -> tuple[int, dict[str, torch.Tensor]]:
    """Receive one update sent by `broadcast_weights` or a sharded publish: (step, {hf_name: tensor})."""
    header = receive_header(group)
    return header.step, receive_tensors(group, header, device=device)
