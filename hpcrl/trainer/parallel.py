"""torch.distributed setup and FSDP2 sharding: one code path for CPU (gloo) and GPU (nccl).

Gradients are SUM-reduced across ranks (not averaged): the loss of every rank is already divided
by the step's global loss-token count, so summing gradients gives exactly the gradient of one big
batch, however samples are spread over ranks and micro-batches.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from hpcrl.models.embeddings import embeddings

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


def all_reduce_sum(x: torch.Tensor | float) -> torch.Tensor:
    return all_reduce(x, "sum")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the largest ``ModuleList`` whose name ends in ``layers`` (HF models
    call it ``model.layers``; peft nests it under ``base_model.model``)."""
    best: nn.ModuleList | None = None
    for name, mod in model.named_modules():
        is_blocks = isinstance(mod, nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks")
        if is_blocks and (best is None or len(mod) > len(best)):
            best = mod
    if best is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return list(best)


def untied_input_embeddings(model: nn.Module) -> nn.Module | None:
    """The input embedding module when its weight is not the LM head's (an untied model: Qwen3-8B and
    larger); None when tied or when the model has no such accessors."""
    emb, head = embeddings(model)
    if emb is None or head is None or emb.weight is head.weight:
        return None
    return emb


def apply_fsdp(
    model: nn.Module,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    force: bool = False,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """FSDP2 ``fully_shard`` on every decoder layer, an untied input embedding on its own, then the
    root (final norm, lm_head, and a tied embedding, which the head needs). A world of 1 is returned as is
    unless ``force`` (sharding over one rank costs time and buys nothing).

    ``param_dtype`` enables mixed precision (e.g. bf16 compute over fp32 master weights).
    ``ignored_params``: left alone (expert-parallel experts, sharded over their own mesh)."""
    if get_world_size() == 1 and not force:
        return model
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in decoder_layers(model):
        fully_shard(
            layer, mp_policy=mp, reshard_after_forward=reshard_after_forward, ignored_params=ignored_params
        )
    emb = untied_input_embeddings(model)
    if emb is not None and not (ignored_params and emb.weight in ignored_params):
        # Its own group: gathered for the first op of the forward and the last of the backward only.
        # In the root group it was gathered through the whole forward (the root's forward is the
        # model's) and the whole backward (from the LM head's to its own), i.e. through the step's
        # peak at the LM head: vocab x hidden in the compute dtype (1.2 GB bf16 at Qwen3-8B).
        fully_shard(emb, mp_policy=mp, reshard_after_forward=True, ignored_params=ignored_params)
    fully_shard(
        model, mp_policy=mp, reshard_after_forward=reshard_after_forward, ignored_params=ignored_params
    )
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            # Sum, not mean: see the module docstring. A divide factor alone would use NCCL's
            # PREMUL_SUM, which gloo lacks; forcing sum-type comms makes it a plain SUM on both.
            # Neither setter recurses in torch, hence the loop over every FSDP module.
            mod.set_gradient_divide_factor(1.0)
            mod.set_force_sum_reduction_for_comms(True)
    return model


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


# ------------------------------------------------------------------------------ meta-device init
def local_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones too, e.g. rotary ``inv_freq``) by name, each
    shared tensor once (tied embeddings). References, not copies."""
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    return out


def _same_structure(named: dict[str, torch.Tensor]) -> bool:
    """Whether every rank has the same tensor names, global shapes and dtypes (collective)."""
    import hashlib

    sig = "\n".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in named.items()).encode()
    mine = torch.frombuffer(bytearray(hashlib.sha256(sig).digest()), dtype=torch.uint8).to(_comm_device())
    ref = mine.clone()
    dist.broadcast(ref, src=0)
    return bool(all_reduce(float(not torch.equal(mine, ref)), "max").item() == 0)


@torch.no_grad()
def fill_from_rank0(model: nn.Module, full: MutableMapping[str, torch.Tensor]) -> None:
    """Fill a sharded model from rank 0's whole tensors ``full`` (``local_tensors`` of the model
    rank 0 loaded, taken before sharding; ``{}`` on the other ranks, whose model was built on the meta
    device and materialised with ``to_empty``). One tensor at a time is broadcast and every rank keeps
    only its rows, so no rank holds a second copy of the model; rank 0 drops each whole tensor from
    ``full`` once it is sent (the dict is consumed), so its copy shrinks as the shards fill. Parameters and buffers alike: buffers
    that are not in the state dict (rotary ``inv_freq``) come from rank 0 too, so a meta-built rank
    never runs with uninitialised memory. Collective: every rank calls it."""
    from torch.distributed.tensor import DTensor

    named = local_tensors(model)
    if not _same_structure(named):
        raise ValueError(
            "meta-device init: the ranks built different models (names, shapes or dtypes differ); "
            "is the model code deterministic?"
        )
    if is_rank0() and set(full) != set(named):
        raise ValueError(
            f"meta-device init: rank 0's loaded tensors differ from the sharded model's: "
            f"{sorted(set(full) ^ set(named))[:4]}"
        )
    from hpcrl.trainer.state import row_range

    comm = _comm_device()
    # One receive buffer per dtype, as large as the largest tensor, and rows copied from views: no
    # per-tensor temporaries for the allocator to keep around (they raised rank 0's peak by ~1/3 of
    # the model in the memory benchmark).
    size: dict[torch.dtype, int] = {}
    for t in named.values():
        size[t.dtype] = max(size.get(t.dtype, 0), t.numel())
    bufs = {} if is_rank0() else {d: torch.empty(n, dtype=d, device=comm) for d, n in size.items()}
    for name, t in named.items():
        if is_rank0():
            src = full.pop(name).detach().to(device=comm, dtype=t.dtype).contiguous()
        else:
            src = bufs[t.dtype][: t.numel()].view(t.shape)
        dist.broadcast(src, src=0)
        if isinstance(t, DTensor):
            _, first, rows = row_range(t)
            t.to_local().copy_(src.narrow(0, first, rows))
        else:
            t.copy_(src)
