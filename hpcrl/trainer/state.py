"""Trainer part of a checkpoint, without pickle: tensors in safetensors, everything else in JSON.

Per rank R under checkpoints/step_N/trainer/:
  rank_R.model.safetensors   this rank's (local shard of the) model state
  rank_R.optim.safetensors   optimizer state tensors, keyed "<param index>.<name>"
  rank_R.json                param groups, scheduler, RNG states, progress, world size

Resuming needs the same number of trainer ranks (shards are per rank).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from hpcrl.paths import RunPaths

FORMAT = 1


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().contiguous().cpu()


def _params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def save_trainer_state(paths: RunPaths, step: int, rank: int, world_size: int, model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer, scheduler: Any, progress: dict[str, Any]) -> None:
    d = paths.trainer_ckpt_dir(step)
    d.mkdir(parents=True, exist_ok=True)
    model_sd = {k: _local(v) for k, v in model.state_dict().items()}
    # Tied weights share storage; safetensors refuses aliases, so store copies.
    save_file({k: v.clone() for k, v in model_sd.items()}, str(d / f"rank_{rank}.model.safetensors"))
    optim_tensors: dict[str, torch.Tensor] = {}
    optim_scalars: dict[str, Any] = {}
    for i, p in enumerate(_params(optimizer)):
        for name, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                optim_tensors[f"{i}.{name}"] = _local(v).clone()
            else:
                optim_scalars[f"{i}.{name}"] = v
    save_file(optim_tensors, str(d / f"rank_{rank}.optim.safetensors"))
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    meta = {
        "format": FORMAT,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "param_groups": groups,
        "optim_scalars": optim_scalars,
        "scheduler": _jsonable(scheduler.state_dict()),
        "rng": {
            "torch": torch.get_rng_state().tolist(),
            "python": _jsonable(random.getstate()),
        },
        "progress": progress,
    }
    (d / f"rank_{rank}.json").write_text(json.dumps(meta))


def _jsonable(v: Any) -> Any:
    if isinstance(v, tuple | list):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, torch.Tensor):
        return v.tolist()
    if v is None or isinstance(v, bool | int | float | str):
        return v
    return None  # callables (lr lambdas) are rebuilt from the config, not stored


def _tuplify(v: Any) -> Any:
    return tuple(_tuplify(x) for x in v) if isinstance(v, list) else v


def load_trainer_state(paths: RunPaths, step: int, rank: int, world_size: int, model: torch.nn.Module,
                       optimizer: torch.optim.Optimizer, scheduler: Any) -> dict[str, Any]:
    """Restore everything save_trainer_state wrote; returns the progress dict."""
    from hpcrl.trainer.optim import load_scheduler_state

    d = paths.trainer_ckpt_dir(step)
    meta = json.loads((d / f"rank_{rank}.json").read_text())
    if meta["world_size"] != world_size:
        raise ValueError(f"checkpoint step_{step} was written by {meta['world_size']} trainer ranks; "
                         f"this run has {world_size} (use the same deployment to resume)")
    saved = load_file(str(d / f"rank_{rank}.model.safetensors"))
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if k not in saved:
                raise ValueError(f"checkpoint step_{step} lacks model tensor {k}")
            _local_view(v).copy_(saved[k])
    optim_saved = load_file(str(d / f"rank_{rank}.optim.safetensors"))
    for i, p in enumerate(_params(optimizer)):
        st: dict[str, Any] = {}
        for key, t in optim_saved.items():
            idx, name = key.split(".", 1)
            if int(idx) == i:
                st[name] = _like_param(t, p)
        for key, v in meta["optim_scalars"].items():
            idx, name = key.split(".", 1)
            if int(idx) == i:
                st[name] = v
        if st:
            optimizer.state[p] = st
    for g, saved_g in zip(optimizer.param_groups, meta["param_groups"], strict=True):
        for k, v in saved_g.items():
            g[k] = _tuplify(v) if k == "betas" else v
    sched = meta["scheduler"]
    sched.pop("lr_lambdas", None)
    load_scheduler_state(scheduler, sched)
    torch.set_rng_state(torch.tensor(meta["rng"]["torch"], dtype=torch.uint8))
    random.setstate(_tuplify(meta["rng"]["python"]))
    return meta["progress"]


def _local_view(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _like_param(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Optimizer state lives like its parameter: a DTensor shard under FSDP, on the same device."""
    if hasattr(p, "device_mesh") and t.dim() > 0:
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(t.to(p.to_local().device), p.device_mesh, p.placements, run_check=False)
    return t.to(p.device) if t.dim() > 0 else t


def trainer_files(paths: RunPaths, step: int) -> list[Path]:
    return sorted(paths.trainer_ckpt_dir(step).glob("rank_*"))
