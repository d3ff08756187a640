"""What every launch does first: output dir, resolved configs, placement, the --dry-run summary."""

from __future__ import annotations

import shutil
from pathlib import Path

from hpcrl.config.loader import Loaded
from hpcrl.config.resolved import write_resolved
from hpcrl.config.schema import CkptConfig, Config, SFTConfig, TrainerModelConfig
from hpcrl.errors import ConfigError
from hpcrl.launch.checks import (
    activation_offload_note,
    context_parallel,
    expert_parallel,
    trainer_precision,
)
from hpcrl.launch.placement import Placement, local_placement
from hpcrl.paths import RunPaths
from hpcrl.runtime import weight_transport


def prepare_output_dir(cfg: Config | SFTConfig, dry_run: bool = False) -> RunPaths:
    """Clean (if asked), create the run layout and write the resolved per-process configs."""
    paths = RunPaths(cfg.output_dir)
    root = paths.root
    if root.exists() and not root.is_dir():
        raise ConfigError("output_dir", f"'{cfg.output_dir}' exists and is not a directory")
    if cfg.clean_output_dir and root.exists() and not dry_run:
        if root == Path.home() or root == Path("/") or root == Path.cwd():
            raise ConfigError("output_dir", f"refusing to clean '{root}'")
        shutil.rmtree(root)
    try:
        if not dry_run:
            paths.make_dirs()
        write_resolved(cfg, paths.configs_dir)
    except OSError as e:  # permissions, read-only or full filesystem: the user's to fix, in one line
        raise ConfigError(
            "output_dir", f"'{cfg.output_dir}' cannot be written ({e.strerror}: {e.filename})"
        ) from None
    return paths


def visible_gpus() -> int:
    """GPUs torch can see; 0 without CUDA (only imports torch when CUDA could exist)."""
    import os

    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return 0
    if not Path("/dev/nvidia0").exists() and not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return 0
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def apply_placement(cfg: Config, placement: Placement) -> None:
    """Record the process counts in the config, so every role knows how many peers it has."""
    context_parallel(cfg, placement.trainer_ranks, on_gpu=placement.uses_gpus and not placement.cpu_compute)
    expert_parallel(cfg, placement.trainer_ranks)
    cfg.deployment.num_trainer_ranks = placement.trainer_ranks
    cfg.deployment.num_inference_servers = placement.inference_servers
    # Decided once here so trainer and orchestrator agree (NCCL on GPUs, files on CPU).
    cfg.trainer.broadcast.transport = weight_transport(cfg, placement.uses_gpus)


def local_plan(loaded: Loaded) -> Placement:
    return local_placement(loaded.config, visible_gpus())


def _model(model: TrainerModelConfig) -> str:
    return f"{model.name}" + (" (LoRA)" if model.lora is not None else "")


def _checkpoints(ckpt: CkptConfig | None) -> str:
    if ckpt is None:
        return "off (enable with --ckpt)"
    return f"every {ckpt.interval} step(s)" if ckpt.interval else "at the end"


def print_summary(loaded: Loaded, placement: Placement, target: str, extra: list[str] | None = None) -> None:
    cfg: Config = loaded.config
    o = cfg.orchestrator
    paths = RunPaths(cfg.output_dir)
    envs = ", ".join(e.name or e.id.rsplit("/", 1)[-1] for e in o.train.env) or "-"
    workers = [e.workers if e.workers is not None else o.env_workers for e in o.train.env]
    if workers:  # docs/envs.md: one env server per env, beside the orchestrator
        where = "in the orchestrator" if not any(workers) else "one env server each"
        envs += f"  ({where}; worker processes: {', '.join(map(str, workers))})"
    lines = [
        f"hpcrl {target}: dry run OK",
        f"model:        {_model(cfg.model)}",
        f"steps:        {cfg.max_steps} (mode {o.training_mode}, max_async_level {o.max_async_level})",
        f"batch:        {o.batch_size} rollouts = {o.batch_size // o.rollouts_per_example} tasks x "
        f"{o.rollouts_per_example}, seq_len {cfg.seq_len}, max_tokens {o.train.sampling.max_tokens}",
        f"envs:         {envs}",
        *placement.summary(),
        *placement.plan(),
        "precision:    "
        + trainer_precision(cfg, on_gpu=placement.uses_gpus and not placement.cpu_compute).describe(),
        f"checkpoints:  {_checkpoints(cfg.ckpt)}",
        f"configs:      {paths.configs_dir}/",
    ]
    lines += extra or []
    lines += activation_offload_note(cfg, on_gpu=placement.uses_gpus and not placement.cpu_compute)
    for n in loaded.notes:
        lines.append(f"note:         {n}")
    print("\n".join(lines))


def print_sft_summary(loaded: Loaded, target: str = "sft") -> None:
    cfg: SFTConfig = loaded.config
    mask = (
        ", ".join(k for k in ("system", "user", "assistant", "tool") if getattr(cfg.loss_mask, k))
        or "nothing"
    )
    val = (
        "off"
        if cfg.val.interval == 0
        else (
            f"every {cfg.val.interval} step(s) on "
            + (
                cfg.val.data.name
                if cfg.val.data is not None
                else f"{cfg.val.fraction:g} of the data held out"
            )
        )
    )
    lines = [
        f"hpcrl {target}: dry run OK",
        f"model:        {_model(cfg.model)}",
        f"data:         {cfg.data.name} (batch {cfg.data.batch_size} {cfg.data.batch_unit}, "
        f"seq_len {cfg.data.seq_len or cfg.seq_len})",
        f"steps:        {cfg.max_steps} (lr {cfg.optim.lr:g}, loss on {mask} turns)",
        f"validation:   {val}",
        "precision:    "
        + trainer_precision(cfg, on_gpu=visible_gpus() > 0 and cfg.deployment.compute != "cpu").describe(),
        f"checkpoints:  {_checkpoints(cfg.ckpt)}",
        f"configs:      {RunPaths(cfg.output_dir).configs_dir}/",
    ]
    lines += activation_offload_note(cfg, on_gpu=visible_gpus() > 0 and cfg.deployment.compute != "cpu")
    lines += [f"note:         {n}" for n in loaded.notes]
    print("\n".join(lines))
