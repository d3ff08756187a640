"""Trainer part of a checkpoint, without pickle: tensors in safetensors, everything else in JSON.

Per rank R under checkpoints/step_N/trainer/:
  rank_R.model.safetensors   this rank's (local shard of the) model state
  rank_R.optim.safetensors   optimizer state tensors, keyed "<param index>.<name>"
  rank_R.json                param groups, scheduler, RNG states, progress, world size, and where
                             each tensor's rows sit in the whole tensor ("shards": global shape + row
                             offset; FSDP2 shards along dim 0)

Resharding: a checkpoint written by N ranks loads on M ranks. Each rank computes which rows of each
whole tensor it holds now and reads exactly those rows from the saved shards that overlap them
(safetensors slices: no rank reads a whole model, nothing is unpickled). With N = M every rank reads
exactly its own file back: the resume is bitwise identical. RNG states are per rank: ranks beyond
the saved N keep their fresh seed (only N = M promises bitwise-identical resumes).
"""

from __future__ import annotations

import json
import logging
import random
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hpcrl.models.parallelize import row_range
from hpcrl.paths import RunPaths

FORMAT = 2  # 1: same world size only (no "shards"); still loaded when N = M
log = logging.getLogger("hpcrl.trainer")


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().contiguous().cpu()


def _params(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _shard_entry(t: torch.Tensor) -> list[Any]:
    shape, first, _ = row_range(t)
    return [shape, first]


def save_trainer_state(
    paths: RunPaths,
    step: int,
    rank: int,
    world_size: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    progress: dict[str, Any],
) -> None:
    d = paths.trainer_ckpt_dir(step)
    d.mkdir(parents=True, exist_ok=True)
    model_state = model.state_dict()
    shards: dict[str, dict[str, Any]] = {
        "model": {k: _shard_entry(v) for k, v in model_state.items()},
        "optim": {},
    }
    # Tied weights share storage; safetensors refuses aliases, so store copies.
    save_file(
        {k: _local(v).clone() for k, v in model_state.items()}, str(d / f"rank_{rank}.model.safetensors")
    )
    optim_tensors: dict[str, torch.Tensor] = {}
    optim_scalars: dict[str, Any] = {}
    for i, p in enumerate(_params(optimizer)):
        for name, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                optim_tensors[f"{i}.{name}"] = _local(v).clone()
                shards["optim"][f"{i}.{name}"] = _shard_entry(v)
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
        "shards": shards,
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


class _Saved:
    """Saved shards of one checkpoint, opened lazily; reads only the rows a rank asks for.
    ``layouts``: (file rank, its "shards" table) for every file that may hold rows."""

    def __init__(self, d: Path, layouts: list[tuple[int, dict[str, Any]]], stack: ExitStack):
        self.d, self.layouts, self.stack = d, layouts, stack
        self._files: dict[tuple[str, int], Any] = {}

    def _file(self, part: str, r: int) -> Any:
        if (part, r) not in self._files:
            f = safe_open(str(self.d / f"rank_{r}.{part}.safetensors"), framework="pt")
            self._files[(part, r)] = self.stack.enter_context(f)
        return self._files[(part, r)]

    def table(self, part: str) -> dict[str, Any]:
        return self.layouts[0][1][part]

    def rows(self, part: str, key: str, first: int, count: int) -> torch.Tensor:
        """Rows [first, first+count) of the whole saved tensor ``key``, from every shard overlapping them."""
        pieces: list[tuple[int, torch.Tensor]] = []  # (first row, rows): file order is not row order
        # under ep with dp_ep > 1 (rank d * ep + e holds rows of expert block e), so they are sorted.
        taken: set[int] = set()  # replicated experts (checkpoints before they were FSDP-sharded): read once
        for r, shards in self.layouts:
            if key not in shards[part]:
                raise ValueError(f"checkpoint rank {r} lacks {part} tensor {key}")
            shape, start = shards[part][key]
            if shape and start in taken:
                continue
            f = self._file(part, r)
            if not shape:  # a scalar (AdamW's step) is the same on every rank
                return f.get_tensor(key)
            sl = f.get_slice(key)
            lo, hi = max(first, start), min(first + count, start + sl.get_shape()[0])
            if lo < hi:
                pieces.append((lo, sl[lo - start : hi - start]))
                taken.add(start)
        if not pieces:
            return self._file(part, self.layouts[0][0]).get_slice(key)[0:0]
        parts = [t for _, t in sorted(pieces, key=lambda p: p[0])]
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
        if out.shape[0] != count:
            raise ValueError(
                f"checkpoint shards of {part} tensor {key} cover {out.shape[0]} of rows "
                f"[{first}, {first + count})"
            )
        return out


def load_trainer_state(
    paths: RunPaths,
    step: int,
    rank: int,
    world_size: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    *,
    load_optimizer: bool = True,
    load_scheduler: bool = True,
) -> dict[str, Any]:
    """Restore everything save_trainer_state wrote, from any number of saved ranks; returns the
    progress dict. ``load_optimizer`` / ``load_scheduler`` False (ckpt.skip_optimizer /
    skip_scheduler): that part keeps its fresh state (the optimizer's param groups, i.e. this run's
    lr, betas and decay, included)."""
    from hpcrl.trainer.optim import load_scheduler_state

    d = paths.trainer_ckpt_dir(step)
    meta, layouts, saved_world = _open_layouts(d, step, rank, world_size)
    with ExitStack() as stack:
        saved = _Saved(d, layouts, stack)
        _load_model(saved, model, step)
        if load_optimizer:
            _load_optimizer(saved, optimizer, meta)
    groups = zip(optimizer.param_groups, meta["param_groups"], strict=True) if load_optimizer else ()
    for g, saved_g in groups:
        for k, v in saved_g.items():
            g[k] = _tuplify(v) if k == "betas" else v
    if load_scheduler:
        sched = meta["scheduler"]
        sched.pop("lr_lambdas", None)
        load_scheduler_state(scheduler, sched)
    if rank < saved_world:
        torch.set_rng_state(torch.tensor(meta["rng"]["torch"], dtype=torch.uint8))
        random.setstate(_tuplify(meta["rng"]["python"]))
    return meta["progress"]


def _open_layouts(
    d: Path, step: int, rank: int, world_size: int
) -> tuple[dict[str, Any], list[tuple[int, dict[str, Any]]], int]:
    """(this rank's saved meta, the shard layouts to read from, saved world size)."""
    saved_world = json.loads((d / "rank_0.json").read_text())["world_size"]
    metas = [json.loads((d / f"rank_{r}.json").read_text()) for r in range(saved_world)]
    meta = metas[min(rank, saved_world - 1)]
    if all("shards" in m for m in metas):
        layouts = [(r, m["shards"]) for r, m in enumerate(metas)]
    elif saved_world == world_size:  # format 1: this rank's own files, read whole
        layouts = [(rank, _whole_file_layout(d, rank))]
    else:
        raise ValueError(
            f"checkpoint step_{step} was written by {saved_world} trainer ranks in format 1 "
            f"(no shard layout); this run has {world_size}: resume with {saved_world} ranks"
        )
    if saved_world != world_size:
        log.warning(
            "resharding checkpoint step_%d: written by %d trainer rank(s), loading on %d",
            step,
            saved_world,
            world_size,
        )
    return meta, layouts, saved_world


def load_optimizer_moments(
    paths: RunPaths, step: int, rank: int, world_size: int, optimizer: torch.optim.Optimizer
) -> None:
    """Another run's optimizer state (warm start): per-parameter tensors and counters only (AdamW's
    exp_avg, exp_avg_sq and step, which its bias correction needs). Param groups (lr, betas, decay)
    stay this run's, as do the scheduler, RNG and progress. Resharded like a resume. Parameters
    must line up one to one (same model, same adapter shape), else ValueError naming the first."""
    d = paths.trainer_ckpt_dir(step)
    meta, layouts, _ = _open_layouts(d, step, rank, world_size)
    params = _params(optimizer)
    for key, (shape, _) in layouts[0][1]["optim"].items():
        idx, name = key.split(".", 1)
        i = int(idx)
        if i >= len(params) or (shape and list(shape) != list(params[i].shape)):
            have = list(params[i].shape) if i < len(params) else "nothing"
            raise ValueError(
                f"optimizer state of {paths.checkpoint_dir(step)} does not fit this run's parameters "
                f"(its parameter {i} {name} is {shape}, here {have}; {len(params)} trainable here): "
                "a warm start carries optimizer state only for the same model and adapter shape"
            )
    with ExitStack() as stack:
        _load_optimizer(_Saved(d, layouts, stack), optimizer, meta)


def _whole_file_layout(d: Path, rank: int) -> dict[str, dict[str, Any]]:
    """Format 1 (no shard table): every tensor of rank R's files, read whole."""
    out: dict[str, dict[str, Any]] = {}
    for part in ("model", "optim"):
        with safe_open(str(d / f"rank_{rank}.{part}.safetensors"), framework="pt") as f:
            out[part] = {k: [list(f.get_slice(k).get_shape()), 0] for k in f.keys()}  # noqa: SIM118
    return out


def _load_model(saved: _Saved, model: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        for k, v in model.state_dict().items():
            if k not in saved.table("model"):
                raise ValueError(f"checkpoint step_{step} lacks model tensor {k}")
            _, first, count = row_range(v)
            _local_view(v).copy_(saved.rows("model", k, first, count))


def _load_optimizer(saved: _Saved, optimizer: torch.optim.Optimizer, meta: dict[str, Any]) -> None:
    names: dict[int, list[str]] = {}
    for key in saved.table("optim"):
        idx, name = key.split(".", 1)
        names.setdefault(int(idx), []).append(name)
    for i, p in enumerate(_params(optimizer)):
        st: dict[str, Any] = {}
        for name in names.get(i, []):
            shape, _ = saved.table("optim")[f"{i}.{name}"]
            if shape:
                _, first, count = row_range(p)
                st[name] = _like_param(saved.rows("optim", f"{i}.{name}", first, count), p)
            else:
                st[name] = saved.rows("optim", f"{i}.{name}", 0, 0)
        for key, v in meta["optim_scalars"].items():
            idx, name = key.split(".", 1)
            if int(idx) == i:
                st[name] = v
        if st:
            optimizer.state[p] = st


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
