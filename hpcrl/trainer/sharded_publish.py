"""Sharded publish over the filesystem: every trainer rank writes its own rows, rank 0 the manifest.

    rank 0 clears broadcasts/step_N (a partial one left by a killed run) -> barrier
    every rank: policy_pieces (its rows, cast to the policy dtype) -> buckets of bucket_mb -> one
        fsynced safetensors file per bucket -> rankR.json (its entries)             -> barrier
    rank 0: manifest.json from every rank's entries (checked: each tensor covered once; the policy
        checksum from the pieces' digests) -> PolicyReady(path, checksum) on the bus

No rank holds more than its shard in the policy dtype (the cast; none when the master weights are
already in it) and one bucket being written. A rank killed mid-publish leaves no manifest.json and
no announcement: servers never load a partial policy (hpcrl.weights.manifest refuses the directory)
and keep the last complete one; the next complete publish of that step starts by clearing it.
"""

from __future__ import annotations

import logging
import shutil
import time
from typing import TYPE_CHECKING

from hpcrl.bus import PolicyReady
from hpcrl.trainer.pieces import policy_pieces
from hpcrl.weights.manifest import finish, write_pieces

if TYPE_CHECKING:
    import torch

    from hpcrl.trainer.publish import PolicyPublisher

log = logging.getLogger("hpcrl.trainer")


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def publish_sharded(pub: PolicyPublisher, model: torch.nn.Module, step: int) -> float:
    """Collective over trainer ranks. Returns seconds spent."""
    t0 = time.perf_counter()
    world = _world()
    final = pub.paths.broadcast_dir(step)
    if pub.rank == 0 and final.exists():
        shutil.rmtree(final)  # a partial publish of this step (a killed run): never mixed with this one
    _barrier()
    bucket = max(1, int(pub.shard_bucket_mb * 2**20))
    written = write_pieces(final, pub.rank, policy_pieces(model, pub.rank, dtype=pub.dtype), bucket)
    pub.last_rank_bytes = written.nbytes
    _barrier()  # every rank's pieces and entries are durable
    if pub.rank != 0:
        return time.perf_counter() - t0
    m = finish(final, step, world)
    pub.last_sync_bytes = m.num_bytes
    pub._bases[step] = None
    pub.bus.publish_policy(
        PolicyReady(
            step=step,
            transport="filesystem",
            path=str(final),
            checksum=m.checksum,
            num_params=m.num_params,
            num_bytes=m.num_bytes,
            base_step=None,
            sync_bytes=m.num_bytes,
        )
    )
    pub._clean_behind(step)
    dt = time.perf_counter() - t0
    log.info(
        "policy %d published (filesystem, sharded over %d rank(s), %.1f MB, rank 0 wrote %.1f MB in %d "
        "file(s), %.2fs, checksum %s)",
        step,
        world,
        m.num_bytes / 1e6,
        written.nbytes / 1e6,
        written.files,
        dt,
        m.checksum[:12],
    )
    return dt


def _decide(pub: PolicyPublisher) -> str:
    """Rank 0's choice of transport for this policy, the same on every rank (one tiny collective):
    files once the orchestrator reported a dead server of the weight group."""
    import torch.distributed as dist

    choice = [pub.transport]
    if pub.rank == 0 and pub.transport == "collective" and pub.paths.weights_fallback_file.exists():
        log.warning("a server of the weight group died: publishing policies as files from now on")
        choice = ["filesystem"]
    if _world() > 1:
        dist.broadcast_object_list(choice, src=0)
    return choice[0]


def publish_collective_stream(pub: PolicyPublisher, model: torch.nn.Module, step: int) -> float:
    """Collective transport, bounded memory: no rank gathers the policy. Collective over trainer ranks.

    1. every rank casts its pieces (its rows, in the policy dtype) and digests them; the (name, dtype,
       shape, rows, digest) records go to every rank (all_gather_object, a few bytes per piece);
    2. rank 0 computes the policy checksum from the digests (the same string as a full export) and
       sends the header; then, tensor by tensor in name order, it receives the other ranks' rows
       (point-to-point on the trainer group), copies its own, and streams the tensor into the weight
       broadcast (`broadcast_stream`: the same wire protocol, receivers unchanged);
    3. a failed broadcast (a server died) is told to every rank, and all publish the same policy
       as files (sharded), as the gathered path falls back.
    Host/device memory: a rank's pieces (its shard in the policy dtype) plus, on rank 0, one tensor
    and one bucket. Rank 0's link still carries every byte to the servers (see docs/weights.md)."""
    import torch.distributed as dist

    from hpcrl.weights.checksum import MOD, combine, tensor_record
    from hpcrl.weights.checksum import rows_digest as digest

    if _decide(pub) == "filesystem":
        if pub.rank == 0:
            pub._fall_back_to_files()
        else:
            pub.transport = "filesystem"
        return publish_sharded(pub, model, step)
    t0 = time.perf_counter()
    world = _world()
    mine = sorted(policy_pieces(model, pub.rank, dtype=pub.dtype), key=lambda p: (p.name, p.row0))
    records = [(p.name, p.dtype, p.shape, p.row0, p.rows, digest(p.tensor, p.row0)) for p in mine]
    everyone = [records]
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, records)
    owners: dict[str, list[tuple[int, int, int]]] = {}  # name -> [(row0, rows, rank)]
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    digests: dict[str, int] = {}
    for r, recs in enumerate(everyone):
        for name, dtype, shape, row0, rows, d in recs:
            owners.setdefault(name, []).append((row0, rows, r))
            layout[name] = (dtype, tuple(shape))
            digests[name] = (digests.get(name, 0) + d) % MOD
    names = sorted(layout)
    pub.last_rank_bytes = sum(p.nbytes for p in mine) if pub.rank != 0 else 0
    if pub.rank != 0:
        for p in mine:  # in (name, row0) order: rank 0 receives in the same order
            dist.send(p.tensor.contiguous(), dst=0)
        failed = [False]
        dist.broadcast_object_list(failed, src=0)
        if failed[0]:
            pub.transport = "filesystem"
            return publish_sharded(pub, model, step)
        return time.perf_counter() - t0
    checksum = combine((n, tensor_record(n, *layout[n], digests[n])) for n in names)
    own = {(p.name, p.row0): p.tensor for p in mine}
    device = mine[0].tensor.device if mine else next(model.parameters()).device

    def tensors():
        import torch

        for name in names:
            dtype, shape = layout[name]
            pieces = sorted(owners[name])
            if len(pieces) == 1 and pieces[0][2] == 0:
                yield own[(name, 0)]
                continue
            out = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            for row0, rows, r in pieces:
                dst = out[row0 : row0 + rows] if shape else out
                if r == 0:
                    dst.copy_(own[(name, row0)])
                else:
                    dist.recv(dst, src=r)  # dim-0 rows of a contiguous tensor: contiguous
            yield out

    from hpcrl.weights.collective import broadcast_stream

    nbytes = sum(_nbytes(*layout[n]) for n in names)
    pub.last_sync_bytes = pub.last_rank_bytes = nbytes
    pub._bases[step] = None
    pub.bus.publish_policy(
        PolicyReady(
            step=step,
            transport="collective",
            checksum=checksum,
            num_params=sum(_numel(layout[n][1]) for n in names),
            num_bytes=nbytes,
            base_step=None,
            sync_bytes=nbytes,
        )
    )
    gen = tensors()
    failed = [False]
    try:
        broadcast_stream(pub.group, [(n, *layout[n]) for n in names], gen, step, bucket_mb=pub.bucket_mb,
                         checksum=checksum)  # fmt: skip
    except RuntimeError as e:  # a receiver died mid-broadcast: drain the other ranks' sends, then files
        log.warning("weight broadcast of policy %d failed (%s): publishing it and every later policy as "
                    "files", step, str(e).splitlines()[0][:200])  # fmt: skip
        for _ in gen:
            pass
        failed = [True]
    if world > 1:
        dist.broadcast_object_list(failed, src=0)
    if failed[0]:
        pub._fall_back_to_files()
        return publish_sharded(pub, model, step)
    pub._clean_behind(step)
    dt = time.perf_counter() - t0
    log.info("policy %d published (collective, streamed from %d rank(s), %.1f MB, %.2fs, checksum %s)",
             step, world, nbytes / 1e6, dt, checksum[:12])  # fmt: skip
    return dt


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    import torch

    return _numel(shape) * getattr(torch, dtype).itemsize
