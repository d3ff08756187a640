"""What every launch does first: output dir, resolved configs, placement, the --dry-run summaries
(run, submit, resume, sft; and `hpcrl trainer | orchestrator | inference --dry-run`, one role's)."""

from __future__ import annotations

import shutil
from pathlib import Path

from hpcrl.config.loader import Loaded
from hpcrl.config.resolved import write_resolved
from hpcrl.config.schema import CkptConfig, Config, SFTConfig, TrainerModelConfig
from hpcrl.errors import ConfigError
from hpcrl.launch import dry_run, memory_sft, vllm_check
from hpcrl.launch.checks import (
    activation_offload_note,
    context_parallel,
    expert_parallel,
    trainer_precision,
)
from hpcrl.launch.memory_sft import SFTGpus
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


def _envs(cfg: Config) -> str:
    o = cfg.orchestrator
    envs = ", ".join(e.name or e.id.rsplit("/", 1)[-1] for e in o.train.env) or "-"
    workers = [e.workers if e.workers is not None else o.env_workers for e in o.train.env]
    if workers:  # docs/envs.md: one env server per env, beside the orchestrator
        where = "in the orchestrator" if not any(workers) else "one env server each"
        envs += f"  ({where}; worker processes: {', '.join(map(str, workers))})"
    return envs


def _steps_and_batch(cfg: Config) -> list[str]:
    o = cfg.orchestrator
    return [
        f"steps:        {cfg.max_steps} (algo {o.algo.type}, max_async_level {o.max_async_level})",
        f"batch:        {o.batch_size} rollouts = {o.batch_size // o.rollouts_per_example} tasks x "
        f"{o.rollouts_per_example}, seq_len {cfg.seq_len}, max_tokens {o.train.sampling.max_tokens}",
    ]


def print_summary(loaded: Loaded, placement: Placement, target: str, extra: list[str] | None = None) -> None:
    cfg: Config = loaded.config
    paths = RunPaths(cfg.output_dir)
    # A submitted job's nodes run offline: its Hub models are fetched when it is submitted (models.hub).
    at = "submission" if "SLURM hetjob" in target else "start"
    checks = dry_run.model_lines(cfg, at=at)  # before any line: a refusal is the only output
    checks += vllm_check.dry_run_lines(cfg)  # [inference.vllm] through vLLM's own parser, where installed
    lines = [
        f"hpcrl {target}: dry run OK",
        f"model:        {_model(cfg.model)}",
        *_steps_and_batch(cfg),
        f"envs:         {_envs(cfg)}",
        *placement.summary(),
        *placement.plan(),
        "precision:    "
        + trainer_precision(cfg, on_gpu=placement.uses_gpus and not placement.cpu_compute).describe(),
        f"checkpoints:  {_checkpoints(cfg.ckpt)}",
        f"configs:      {paths.configs_dir}/",
        *checks,
    ]
    lines += extra or []
    lines += activation_offload_note(cfg, on_gpu=placement.uses_gpus and not placement.cpu_compute)
    for n in loaded.notes:
        lines.append(f"note:         {n}")
    print("\n".join(lines))


def _sft_evals(cfg: SFTConfig) -> str:
    ev = cfg.eval
    if ev is None:
        return "off ([eval] for prime-rl's online evaluation)"
    names = ", ".join(e.name or e.id for e in ev.env) or "no env"
    first = "" if ev.skip_first_step else "step 0, "
    return f"{first}every {ev.interval} step(s) and the last, on {names} (hpcrl eval of evals/step_N/weights)"


def print_sft_summary(loaded: Loaded, target: str = "sft", gpus: SFTGpus | None = None) -> None:
    """`gpus`: where the run goes (`hpcrl submit`'s layout); unset: this machine (`hpcrl sft`)."""
    cfg: SFTConfig = loaded.config
    checks = dry_run.model_lines(cfg) + dry_run.dataset_lines(cfg)
    visible = visible_gpus()
    on_gpu = (gpus.node if gpus is not None else visible) > 0
    checks += memory_sft.dry_run_lines(cfg, gpus or memory_sft.local_gpus(cfg, visible), on_gpu)
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
        f"online evals: {_sft_evals(cfg)}",
        "precision:    "
        + trainer_precision(cfg, on_gpu=visible_gpus() > 0 and cfg.deployment.compute != "cpu").describe(),
        f"checkpoints:  {_checkpoints(cfg.ckpt)}",
        f"configs:      {RunPaths(cfg.output_dir).configs_dir}/",
        *checks,
    ]
    lines += activation_offload_note(cfg, on_gpu=visible_gpus() > 0 and cfg.deployment.compute != "cpu")
    lines += [f"note:         {n}" for n in loaded.notes]
    print("\n".join(lines))


# -- `hpcrl trainer | orchestrator | inference --dry-run`: one role, as the launcher would start it ----
def _trainer_data_lines(cfg: Config, paths: RunPaths, on_gpu: bool) -> list[str]:
    fake = cfg.trainer.data.fake
    if fake is not None:  # hpcrl.trainer.rl_fake
        shape = "packed samples" if fake.generate_samples else "one sample each"
        return [
            f"data:         fake: {fake.batch_size} row(s) of {cfg.seq_len} random tokens per step "
            f"({shape}), no orchestrator",
            "policy:       not published (fake data: no inference servers)",
        ]
    return [
        f"rollouts:     {paths.rollouts_dir}/ (from the orchestrator)",
        f"policy:       published by {weight_transport(cfg, on_gpu)} to the inference servers",
    ]


def print_role_summary(loaded: Loaded, role: str, run_dir: str | None = None, server_index: int = 0) -> None:
    """What `hpcrl <role>` would start, after the model checks; starts and writes nothing."""
    cfg: Config = loaded.config
    checks = dry_run.model_lines(cfg, role)  # before any line: a refusal is the only output
    checks += vllm_check.dry_run_lines(cfg) if role == "inference" else []  # vLLM's parser, where installed
    on_gpu = visible_gpus() > 0 and cfg.deployment.compute != "cpu"
    body = {"trainer": _trainer_lines, "orchestrator": _orchestrator_lines}.get(role)
    lines = body(cfg, on_gpu) if body is not None else _inference_lines(cfg, on_gpu, run_dir, server_index)
    notes = [f"note:         {n}" for n in loaded.notes]
    print("\n".join([f"hpcrl {role}: dry run OK", *lines, *checks, *notes]))


def _trainer_lines(cfg: Config, on_gpu: bool) -> list[str]:
    model = cfg.trainer.model or cfg.model
    optim = cfg.trainer.optim
    paths = RunPaths(cfg.output_dir)
    ranks = cfg.deployment.num_trainer_ranks or 1
    return [
        f"model:        {_model(model)}",
        f"trainer:      {ranks} rank(s) on {'CUDA (NCCL)' if on_gpu else 'CPU (gloo)'}; "
        "this rank from RANK / WORLD_SIZE (or SLURM's)",
        f"steps:        {cfg.max_steps} ({optim.type}, lr {optim.lr:g}, {optim.scheduler})",
        *_trainer_data_lines(cfg, paths, on_gpu),
        "precision:    " + trainer_precision(cfg, on_gpu=on_gpu).describe(),
        f"checkpoints:  {_checkpoints(cfg.ckpt)}",
        f"run dir:      {paths.root}/",
    ]


def _orchestrator_lines(cfg: Config, on_gpu: bool) -> list[str]:
    o = cfg.orchestrator
    paths = RunPaths(cfg.output_dir)
    servers = cfg.deployment.num_inference_servers or 1
    lines = [
        f"tokenizer:    {dry_run.role_model(cfg, 'orchestrator')[1]}",
        *_steps_and_batch(cfg),
        f"envs:         {_envs(cfg)}",
        f"inference:    waits for {servers} server(s) to announce themselves in {paths.servers_dir}/; "
        f"policies by {weight_transport(cfg, on_gpu)}",
    ]
    if (frozen := o.algo.frozen) is not None:  # opd's teacher, sft's sampling source
        lines.append(f"teacher:      {frozen.base_url}" + (f" ({frozen.name})" if frozen.name else ""))
    for e in o.train.env:  # per-env algorithms (prime-rl's per-source algo)
        if e.algo is not None:
            teacher = e.algo.frozen
            where = f", teacher {teacher.base_url}" if teacher is not None else ""
            lines.append(f"env algo:     {e.name or e.id}: {e.algo.type}{where}")
    return [*lines, f"checkpoints:  {_checkpoints(cfg.ckpt)}", f"run dir:      {paths.root}/"]


def _inference_lines(cfg: Config, on_gpu: bool, run_dir: str | None, server_index: int) -> list[str]:
    from hpcrl.inference.server import serve_options

    opts = serve_options(cfg, run_dir, server_index)  # validated as the server validates them
    lora = f", LoRA adapters up to rank {opts.lora_rank}" if opts.lora_rank else ""
    port = opts.port or "a free port"
    guard = "bearer token required" if opts.api_key else "no API key"
    lines = [
        f"model:        {opts.served_model_name} (dtype {opts.dtype}{lora})",
        f"backend:      {opts.backend} (max_model_len {opts.max_model_len}, max_batch_size {opts.max_batch_size})",
        f"devices:      {f'{opts.tp} GPU(s) (tensor parallel {opts.tp})' if on_gpu else 'CPU'}",
        f"listens on:   {opts.host}:{port} ({guard})",
    ]
    if run_dir is not None:
        lines.append(f"announces:    {RunPaths(run_dir).server_file(server_index)}")
    return lines
