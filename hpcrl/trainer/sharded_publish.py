"""Sharded publish: every trainer rank writes (filesystem) or broadcasts (collective) its own rows.

    rank 0 clears broadcasts/step_N (a partial one left by a killed run) -> barrier
    every rank: policy_pieces (its rows, cast to the policy dtype) -> buckets of bucket_mb -> one
        fsynced safetensors file per bucket -> rankR.json (its entries)             -> barrier
    rank 0: manifest.json from every rank's entries (checked: each tensor covered once; the policy
        checksum from the pieces' digests)                                          -> barrier
    rank 0: PolicyReady(path, checksum) on the bus

Each barrier is the agreement of the storage policy (hpcrl.storage.retry_together): a write the
filesystem refuses on any rank is retried by every rank together, and past storage_timeout_s every
rank ends with the same one line.

No rank holds more than its shard in the policy dtype (the cast; none when the master weights are
already in it) and one bucket being written. A rank killed mid-publish leaves no manifest.json and
no announcement: servers never load a partial policy (hpcrl.weights.manifest refuses the directory)
and keep the last complete one; the next complete publish of that step starts by clearing it.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from hpcrl.bus import PolicyReady
from hpcrl.trainer.pieces import policy_pieces
from hpcrl.weights.manifest import delta_file, finish, write_delta, write_pieces
from hpcrl.weights.shards import Piece

if TYPE_CHECKING:
    import torch

    from hpcrl.trainer.publish import PolicyPublisher

log = logging.getLogger("hpcrl.trainer")


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def publish_sharded(pub: PolicyPublisher, model: torch.nn.Module, step: int) -> float:
    """Collective over trainer ranks. Returns seconds spent."""
    t0 = time.perf_counter()
    world = _world()
    final = pub.paths.broadcast_dir(step)
    what = f"policy {step}"

    def clear() -> None:  # a partial publish of this step (a killed run): never mixed with this one
        if pub.rank == 0 and final.exists():
            shutil.rmtree(final)

    # Every write goes through store_together: refused on any rank, all ranks retry, wait and end
    # together (no rank is left in a collective); each also serves as the barrier after it.
    pub.store_together(what, final, clear)
    bucket = max(1, int(pub.shard_bucket_mb * 2**20))
    delta_meta, sync_bytes = None, None
    if pub.delta:  # O(shard): this rank's pieces on the host, and its previous ones
        pieces = policy_pieces(model, pub.rank, dtype=pub.dtype)
        held = [Piece(p.name, p.shape, p.row0, p.tensor.detach().to("cpu", copy=True)) for p in pieces]
        delta, sync_bytes = _shard_delta(pub, held, step, world)
        if delta is not None:
            written = pub.store_together(
                what, final, lambda: write_delta(final, pub.rank, delta, held), each_own=True
            )
            delta_meta = {
                "base_step": pub._prev_step,
                "base_checksum": pub._prev_checksum,
                "files": [delta_file(r) for r in range(world)],
            }
        else:
            written = pub.store_together(
                what, final, lambda: write_pieces(final, pub.rank, held, bucket), each_own=True
            )
        _remember(pub, held, step, delta)
    else:

        def write() -> Any:  # a retry iterates the pieces afresh, every rank in step (gathers pace it)
            pieces = policy_pieces(model, pub.rank, dtype=pub.dtype)
            try:
                return write_pieces(final, pub.rank, pieces, bucket)
            finally:  # refused mid-way: still take part in the gathers the other ranks' pieces need
                deque(pieces, maxlen=0)

        written = pub.store_together(what, final, write)
    pub.last_rank_bytes = written.nbytes
    # after every rank's pieces and entries are durable
    m = pub.store_together(
        what, final, lambda: finish(final, step, world, delta=delta_meta) if pub.rank == 0 else None
    )
    msg = None
    if pub.rank == 0:
        pub.last_sync_bytes = m.num_bytes if sync_bytes is None else sync_bytes
        pub._bases[step] = None if delta_meta is None else delta_meta["base_step"]
        if pub.delta:
            pub._prev_checksum = m.checksum
        msg = PolicyReady(
            step=step,
            transport="filesystem",
            path=str(final),
            checksum=m.checksum,
            num_params=m.num_params,
            num_bytes=m.num_bytes,
            base_step=pub._bases[step],
            sync_bytes=pub.last_sync_bytes,
        )
    pub.announce(step, msg)  # rank 0 writes it; every rank takes part (refused: all wait, all end)
    if pub.rank != 0:
        return time.perf_counter() - t0
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


def _shard_delta(pub: PolicyPublisher, pieces: list[Piece], step: int, world: int) -> tuple[Any, int | None]:
    """This rank's delta against its previous pieces, or None for a full sync: the first, every
    `full_every`, and whenever the ranks' deltas together would not be smaller (the same answer on
    every rank: the sizes go to all). Also the bytes every rank sends together (None: full)."""
    import torch.distributed as dist

    from hpcrl.weights.delta import encode_delta

    if pub._prev is None or pub._prev_step >= step or step - pub._last_full >= pub.full_every:
        return None, None
    delta = encode_delta(pub._prev, {p.key: p.tensor for p in pieces}, pub._prev_step, "")
    sizes = [(delta.nbytes, sum(p.nbytes for p in pieces))]
    if world > 1:
        sizes = [None] * world
        dist.all_gather_object(sizes, (delta.nbytes, sum(p.nbytes for p in pieces)))
    total, full = sum(a for a, _ in sizes), sum(b for _, b in sizes)
    return (delta, total) if total < full else (None, None)


def _remember(pub: PolicyPublisher, pieces: list[Piece], step: int, delta: Any) -> None:
    """Keep this rank's policy pieces as the next delta's base (applying the delta touches only the
    changed elements)."""
    from hpcrl.weights.delta import apply_delta

    if delta is None or pub._prev is None:
        pub._prev = {p.key: p.tensor for p in pieces}
        pub._last_full = step
    else:
        apply_delta(pub._prev, delta)
    pub._prev_step = step


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


def _any(flag: bool) -> bool:
    """Whether any trainer rank says `flag` (the same answer on every rank)."""
    if _world() == 1:
        return flag
    from hpcrl.trainer.parallel import all_reduce

    return bool(all_reduce(float(flag), op="max").item() > 0)


def publish_collective(pub: PolicyPublisher, model: torch.nn.Module, step: int) -> float:
    """Collective transport, sharded: every trainer rank sends its own pieces to the servers, all at
    once, in rounds (hpcrl.weights.rounds). Collective over trainer ranks; every trainer rank is a
    member (a sender) of the weight group.

    1. every rank casts its pieces one at a time, cuts them into buckets of chunk_mb / ranks and
       digests every part (on the device; the cast piece is dropped again);
    2. the part records (a few bytes each) go to every rank (`all_gather_object`): every rank knows
       the rounds (bucket k of every rank in round k); rank 0 computes the policy checksum from the
       digests, announces PolicyReady and sends the header;
    3. every rank casts its pieces again, lazily, and sends each bucket to every server's head in its
       round. A model whose pieces need collectives to build (LoRA, a layout that is not a run of rows)
       is cast once and held instead: rank pieces are then built in step on every rank, before any send.
    A broadcast that fails on any rank (a server died) is told to every rank (one all-reduce) and all
    of them publish the same policy as sharded files. Memory per rank: its largest cast piece and one
    bucket (the held shard for LoRA); no rank holds another's rows."""
    from hpcrl.trainer.pieces import pieces_are_local
    from hpcrl.weights import collective as coll
    from hpcrl.weights.rounds import send_rounds

    if _decide(pub) == "filesystem":
        pub._fall_back_to_files()
        return publish_sharded(pub, model, step)
    t0 = time.perf_counter()
    world = _world()
    if pub.group.senders != world:
        raise RuntimeError(
            f"the weight group counts {pub.group.senders} trainer rank(s), the trainer has {world}"
        )
    bucket = max(1, int(pub.bucket_mb * 2**20))
    mine_bytes = max(1, bucket // world)  # a round (every rank's bucket k) stays within chunk_mb
    if pieces_are_local(model):

        def pieces():
            return policy_pieces(model, pub.rank, dtype=pub.dtype)

    else:  # built with collectives: once, in step on every rank, and held
        held = list(policy_pieces(model, pub.rank, dtype=pub.dtype))

        def pieces():
            return iter(held)

    records = coll.bucket_records(coll.iter_buckets(pieces(), mine_bytes))
    everyone = [records]
    if world > 1:
        import torch.distributed as dist

        everyone = [None] * world
        dist.all_gather_object(everyone, records)
    rounds = coll.schedule(everyone)
    pub.last_rank_bytes = sum(coll._nbytes(r[1], (r[4], *r[2][1:])) for b in records for r in b)
    header, msg = None, None
    if pub.rank == 0:
        tensors, checksum = coll.layout_and_checksum(rounds)
        nbytes = sum(coll._nbytes(d, s) for _, d, s in tensors)
        pub.last_sync_bytes = nbytes
        pub._bases[step] = None
        msg = PolicyReady(
            step=step,
            transport="collective",
            checksum=checksum,
            num_params=sum(nbytes_to_numel(d, s) for _, d, s in tensors),
            num_bytes=nbytes,
            base_step=None,
            sync_bytes=nbytes,
        )
        header = coll.make_header(
            step, bucket, checksum, tensors, rounds, senders=world, servers=pub.group.server_ranks()
        )
    pub.announce(step, msg)  # rank 0 writes it; every rank takes part (refused: all wait, all end)
    failed = False
    try:
        if header is not None:
            coll.send_header(pub.group, header)
            parsed = coll._parse_header(header)
        else:
            parsed = coll.receive_header(pub.group)
        send_rounds(pub.group, parsed, coll.iter_buckets(pieces(), mine_bytes))
    except RuntimeError as e:  # a receiver died mid-broadcast (gloo/NCCL: connection closed, timeout)
        log.warning("weight broadcast of policy %d failed on trainer rank %d (%s): publishing it and every "
                    "later policy as files", step, pub.rank, str(e).splitlines()[0][:200])  # fmt: skip
        failed = True
    if _any(failed):
        pub._fall_back_to_files()
        return publish_sharded(pub, model, step)
    dt = time.perf_counter() - t0
    if pub.rank == 0:
        pub._clean_behind(step)
        log.info("policy %d published (collective, %d rank(s) sending at once in %d round(s), %.1f MB, "
                 "%.2fs, checksum %s)", step, world, len(rounds), pub.last_sync_bytes / 1e6, dt,
                 parsed.checksum[:12])  # fmt: skip
    return dt


def nbytes_to_numel(dtype: str, shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
