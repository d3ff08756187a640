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
