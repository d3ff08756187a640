"""Weight broadcast over a torch.distributed group between the trainer and inference servers.

The group is made between independently started processes (the trainer and every server rank) from a
TCPStore that the trainer hosts: a raw ProcessGroupGloo (CPU) or ProcessGroupNCCL (GPU) on a
PrefixStore, so it never touches the trainer's default (FSDP) process group.

Wire protocol (one update; rank `src` sends, every other rank receives):

1. header length: int64 tensor of shape [1];
2. header: uint8 tensor holding UTF-8 JSON
   {"version": 2, "step": N, "bucket_bytes": B, "checksum": str | null,
    "delta": manifest | null, "adapter": peft adapter config | null,
    "tensors": [[hf_name, dtype, shape], ...]};
   with "adapter" the tensors are a LoRA adapter's (peft names, what adapter_model.safetensors holds)
   and the receiver merges them onto its base weights instead of replacing the weights;
3. payload: the tensors' raw bytes, concatenated in header order, sent as consecutive chunks of at
   most B bytes. A tensor of PACK_BELOW bytes or more is sent straight from / received straight into
   its own memory; smaller consecutive tensors are packed together into a scratch bucket.

Names are Hugging Face parameter names (what `save_pretrained` writes), so the receiver loads them
like a safetensors file. No pickle anywhere: the header is JSON and the payload raw bytes.
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

PROTOCOL_VERSION = 2  # 2: tensors >= PACK_BELOW bytes are never packed with others
PACK_BELOW = 256 * 2**10
DEFAULT_BUCKET_MB = 128
_PREFIX = "hpcrl-weights"


@dataclass
class WeightGroup:
    """A process group used only for weight broadcast (rank 0 is the trainer by convention)."""

    pg: Any
    rank: int
    world_size: int
    backend: str
    device: Any  # torch.device the payload lives on (cpu for gloo, cuda for nccl)
    store: Any = field(repr=False)  # keep the store alive as long as the group


@dataclass
class WeightsHeader:
    step: int
    bucket_bytes: int
    checksum: str | None
    tensors: list[tuple[str, str, tuple[int, ...]]]
    delta: dict[str, Any] | None = None  # hpcrl.weights.delta manifest: the tensors encode a delta
    adapter: dict[str, Any] | None = None  # LoRA: the adapter's peft config; the tensors are its weights

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
    return WeightGroup(pg=pg, rank=rank, world_size=world_size, backend=backend, device=device, store=store)


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


def _byte_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    import torch

    return [t.reshape(-1).view(torch.uint8) for t in tensors]


def _chunks(sizes: list[int], bucket: int) -> Iterable[list[tuple[int, int, int]]]:
    """Split the concatenated byte stream into chunks; yield [(tensor index, start, end), ...] per chunk.

    Only tensors below PACK_BELOW share a chunk (packed through a scratch bucket); a larger tensor is
    sent straight from its own memory in pieces of at most `bucket` bytes. Packing a 100 MB tensor
    would cost a copy on each side (~0.1 s each on a loaded CPU) to save one broadcast call (~0.1 ms).
    """
    i = 0
    while i < len(sizes):
        if sizes[i] >= PACK_BELOW or sizes[i] >= bucket:
            for a in range(0, sizes[i], bucket):
                yield [(i, a, min(sizes[i], a + bucket))]
            i += 1
            continue
        pieces, room = [], bucket
        while i < len(sizes) and sizes[i] < PACK_BELOW and sizes[i] <= room:
            if sizes[i]:
                pieces.append((i, 0, sizes[i]))
            room -= sizes[i]
            i += 1
        if pieces:
            yield pieces


def _stream(
    group: WeightGroup,
    views: Any,
    bucket: int,
    src: int,
    sending: bool,
    sizes: list[int] | None = None,
) -> None:
    """`views`: byte views indexed in non-decreasing order (a list, or `_Lazy` with `sizes` given)."""
    import torch

    sizes = [v.numel() for v in views] if sizes is None else sizes
    scratch: torch.Tensor | None = None
    for pieces in _chunks(sizes, bucket):
        if len(pieces) == 1:  # inside one tensor: no copy
            i, a, b = pieces[0]
            _broadcast(group, views[i][a:b].to(group.device), src)
            continue
        n = sum(b - a for _, a, b in pieces)
        if scratch is None:  # no bigger than the whole payload: small models stay small
            scratch = torch.empty(min(bucket, sum(sizes)), dtype=torch.uint8, device=group.device)
        buf = scratch[:n]
        pos = 0
        if sending:
            for i, a, b in pieces:
                buf[pos : pos + b - a].copy_(views[i][a:b])
                pos += b - a
        _broadcast(group, buf, src)
        if not sending:
            for i, a, b in pieces:
                views[i][a:b].copy_(buf[pos : pos + b - a])
                pos += b - a


def broadcast_weights(
    group: WeightGroup,
    named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    step: int,
    *,
    src: int = 0,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    checksum: str | None = None,
    delta: dict[str, Any] | None = None,
    adapter: dict[str, Any] | None = None,
) -> None:
    """Send `named_tensors` (HF names) as policy `step` to every other rank of `group`; with `delta`
    (a Delta manifest) they are that delta's encoded tensors and `checksum` the full result's; with
    `adapter` (a JSON-able peft LoRA config) they are that adapter's tensors and `checksum` theirs."""
    if delta is not None and adapter is not None:
        raise ValueError("a broadcast carries either a weight delta or a LoRA adapter, not both")
    import torch

    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else list(named_tensors)
    tensors = [t.detach().to(group.device).contiguous() for _, t in items]
    bucket = max(1, int(bucket_mb * 2**20))
    header = {
        "version": PROTOCOL_VERSION,
        "step": int(step),
        "bucket_bytes": bucket,
        "checksum": checksum,
        "delta": delta,
        "adapter": adapter,
        "tensors": [
            [name, str(t.dtype).removeprefix("torch."), list(t.shape)] for (name, _), t in zip(items, tensors)
        ],
    }
    raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(group.device)
    _broadcast(group, torch.tensor([raw.numel()], dtype=torch.int64, device=group.device), src)
    _broadcast(group, raw, src)
    _stream(group, _byte_views(tensors), bucket, src, sending=True)


class _Lazy:
    """Byte views of tensors made one at a time by an iterator, asked for in non-decreasing index
    order (what `_chunks` does): only the newest tensor is held. The iterator may also yield an object
    whose `[a:b]` gives those bytes (uint8, on the group's device), asked in increasing order: then
    not even one tensor is held whole."""

    def __init__(self, tensors: Iterator[torch.Tensor], device: Any):
        self._it, self._device, self._i, self._cur = tensors, device, -1, None

    def __getitem__(self, i: int) -> torch.Tensor:
        import torch

        assert i >= self._i, (i, self._i)
        while self._i < i:
            self._cur = None
            t = next(self._it)
            if isinstance(t, torch.Tensor):
                self._cur = t.detach().to(self._device).contiguous().reshape(-1).view(torch.uint8)
            else:  # a byte source sliced in increasing order (hpcrl.trainer.stream.RowSource)
                self._cur = t
            self._i += 1
        return self._cur


def broadcast_stream(
    group: WeightGroup,
    layout: list[tuple[str, str, tuple[int, ...]]],
    tensors: Iterator[torch.Tensor],
    step: int,
    *,
    src: int = 0,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    checksum: str | None = None,
) -> None:
    """`broadcast_weights` with the tensors made one at a time (the same wire protocol, so receivers
    are unchanged): `layout` gives (name, dtype, shape) of each, in the order `tensors` yields them.
    The sender holds one tensor and one scratch bucket, never the whole policy."""
    import torch

    bucket = max(1, int(bucket_mb * 2**20))
    header = {
        "version": PROTOCOL_VERSION,
        "step": int(step),
        "bucket_bytes": bucket,
        "checksum": checksum,
        "delta": None,
        "adapter": None,
        "tensors": [[n, d, list(s)] for n, d, s in layout],
    }
    raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(group.device)
    _broadcast(group, torch.tensor([raw.numel()], dtype=torch.int64, device=group.device), src)
    _broadcast(group, raw, src)
    sizes = [_nbytes(d, s) for _, d, s in layout]
    _stream(group, _Lazy(tensors, group.device), bucket, src, sending=True, sizes=sizes)


def receive_header(group: WeightGroup, *, src: int = 0) -> WeightsHeader:
    """First half of a receive: the header (step, names, dtypes, shapes, optional checksum)."""
    import torch

    length = torch.zeros(1, dtype=torch.int64, device=group.device)
    _broadcast(group, length, src)
    raw = torch.empty(int(length.item()), dtype=torch.uint8, device=group.device)
    _broadcast(group, raw, src)
    meta = json.loads(bytes(raw.cpu().numpy()).decode())
    if meta.get("version") != PROTOCOL_VERSION:
        raise ValueError(f"weights protocol version {meta.get('version')} != {PROTOCOL_VERSION}")
    return WeightsHeader(
        step=int(meta["step"]),
        bucket_bytes=int(meta["bucket_bytes"]),
        checksum=meta.get("checksum"),
        tensors=[(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in meta["tensors"]],
        delta=meta.get("delta"),
        adapter=meta.get("adapter"),
    )


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
    src: int = 0,
    device: Any = None,
    into: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Second half of a receive: the payload, into tensors on `device` (default: the group's).

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
    views = _byte_views(list(out.values()))
    if dev != group.device:  # e.g. NCCL into GPU buffers, then the caller wants CPU tensors
        staged = [torch.empty_like(v, device=group.device) for v in views]
        _stream(group, staged, header.bucket_bytes, src, sending=False)
        for v, s in zip(views, staged):
            v.copy_(s)
    else:
        _stream(group, views, header.bucket_bytes, src, sending=False)
    return out


def receive_weights(
    group: WeightGroup, *, src: int = 0, device: Any = None
) -> tuple[int, dict[str, torch.Tensor]]:
    """Receive one update sent by `broadcast_weights`: (step, {hf_name: tensor})."""
    header = receive_header(group, src=src)
    return header.step, receive_tensors(group, header, src=src, device=device)
