"""torch.distributed setup for a trainer process: its rank layout, joining the process group (gloo on
CPU, nccl on GPU), the collectives the loops use, and the clean exit. What shards a model (FSDP2,
cp, vocab-parallel, the meta-device fill) is the model's: :mod:`hpcrl.models.parallelize`, called
through the family spec (:mod:`hpcrl.models.spec`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn

_JOINED = False  # init_distributed ran in this process


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list: ``"gpu[03-05,7],cpu1" -> "gpu03"``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m or not m.group(1):
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def dist_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Rank layout from torchrun-style variables, else from SLURM's (``srun`` sets those).

    Without either it is a single process on localhost."""
    env = os.environ if environ is None else environ

    def pick(*names: str, default: str | None = None) -> str | None:
        for n in names:
            if env.get(n):
                return env[n]
        return default

    rank = int(pick("RANK", "SLURM_PROCID", default="0"))
    world = int(pick("WORLD_SIZE", "SLURM_NTASKS", default="1"))
    local = int(pick("LOCAL_RANK", "SLURM_LOCALID", default="0"))
    addr = pick("MASTER_ADDR")
    if addr is None:
        nodes = pick("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
        addr = first_host(nodes) if nodes else "127.0.0.1"
    port = pick("MASTER_PORT")
    if port is None:
        # Deterministic per job so every rank agrees without talking; away from ephemeral ports.
        job = int(pick("SLURM_JOB_ID", default="0"))
        port = str(20000 + job % 10000)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world}")
    return DistEnv(rank=rank, world_size=world, local_rank=local, master_addr=addr, master_port=int(port))


def device_for(local_rank: int = 0) -> torch.device:
    """This rank's device. A rank bound to one GPU (hpcrl.runtime.bind_gpus, the local
    launcher) sees it as cuda:0; ranks that share a node's GPU list use their local rank."""
    from hpcrl.runtime import use_cuda

    if not use_cuda():
        return torch.device("cpu")
    return torch.device("cuda", 0 if torch.cuda.device_count() == 1 else local_rank)


def init_distributed(device: torch.device | None = None, timeout_s: float = 1800.0) -> DistEnv:
    """Join the process group (nccl on CUDA, gloo on CPU). A no-op when already initialised.

    A world of 1 still gets a (gloo/nccl) group so collectives used by the loop are plain no-ops."""
    env = dist_env()
    device = device or device_for(env.local_rank)
    if dist.is_initialized():
        return env
    global _JOINED
    _JOINED = True
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", env.master_addr)
    os.environ.setdefault("MASTER_PORT", str(env.master_port))
    dist.init_process_group(
        backend="nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    return env


def hard_exit(code: int) -> NoReturn:
    """End a process that ran torch.distributed without interpreter teardown. After the group is
    destroyed, C++ objects of gloo/FSDP freed during teardown can abort the process ("terminate called
    without an active exception", SIGABRT) although its work is done, which a launcher would read as
    a crash. Everything teardown would do that matters is done here first: non-daemon threads (e.g.
    checkpoint finalisers writing COMPLETE) are joined as Python's own shutdown joins them, logs and
    standard streams are flushed."""
    import logging
    import sys
    import threading

    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t.join()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def ran_distributed() -> bool:
    """Whether this process joined a process group (the processes hard_exit is for)."""
    return _JOINED


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def get_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_rank0() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _comm_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(x: torch.Tensor | float, op: str = "sum") -> torch.Tensor:
    """All-reduce a copy of ``x`` (sum/max/min) and return it on ``x``'s device; identity alone."""
    t = torch.as_tensor(x).detach().clone()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    if op not in ops:
        raise ValueError(f"all_reduce op {op!r} is not one of {sorted(ops)}")
    home = t.device
    t = t.to(_comm_device())
    dist.all_reduce(t, op=ops[op])
    return t.to(home)


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order; `[obj]` alone. Collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def write_together(
    role: str, what: str, path: Any, write: Any, timeout_s: float, *, each_own: bool = False
) -> Any:
    """`write()` on every rank at once under the storage policy: refused, the ranks retry, wait and
    end together (hpcrl.storage.retry_together; `each_own`: rank-local parts). Collective."""
    from hpcrl.storage import retry_together

    return retry_together(
        role, what, write, timeout_s, gather=all_gather_object, path=path, each_own=each_own
    )


def all_reduce_sum(x: torch.Tensor | float) -> torch.Tensor:
    return all_reduce(x, "sum")


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Raw (module-named) full state dict on CPU on rank 0, ``{}`` elsewhere.

    Collective: every rank must call it. Gathers one tensor at a time to bound peak memory."""
    out: dict[str, torch.Tensor] = {}
    keep = is_rank0()
    for name, t in model.state_dict().items():
        full = t.full_tensor() if hasattr(t, "full_tensor") else t
        if keep:
            out[name] = full.detach().to("cpu", copy=True)
    return out
