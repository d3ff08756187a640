"""Sections every root shares: [ckpt], [wandb] and [log] (also restated by trainer and orchestrator), and
the renderer section ([orchestrator.renderer] for RL / eval / GEPA, [renderer] for SFT)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from hpcrl.config.sections.base import D, Section


class CkptConfig(Section):
    interval: Annotated[
        Annotated[int, Meta(ge=1)] | None, D("Checkpoint every N steps (unset: at the end only).")
    ] = None
    keep_last: Annotated[Annotated[int, Meta(ge=1)] | None, D("Keep only the newest K checkpoints.")] = None
    keep_interval: Annotated[
        Annotated[int, Meta(ge=1)] | None, D("Also keep every M-th step permanently.")
    ] = None
    resume_step: Annotated[
        Annotated[int, Meta(ge=-1)] | None, D("Resume from this checkpoint step (-1 = newest complete).")
    ] = None
    skip_optimizer: Annotated[
        bool, D("Resume: load the model (and scheduler) but start the optimizer state afresh.")
    ] = False
    skip_scheduler: Annotated[
        bool, D("Resume: start a fresh LR schedule over the remaining steps instead of the saved one.")
    ] = False
    weights_only: Annotated[
        bool, D("Write only weights/step_N (HF dir), no optimizer/orchestrator state.")
    ] = False
    hf_weights: Annotated[
        Literal["auto", "always", "never"],
        D(
            "Write weights/step_N (HF safetensors, rank 0 alone) at each checkpoint: auto = when the "
            "policy is at most 16 GiB; otherwise `hpcrl export STEP_DIR` writes them from the checkpoint."
        ),
    ] = "auto"
    save_adapter_separately: Annotated[bool, D("LoRA: also write the raw adapter beside merged weights.")] = (
        False
    )
    adapter_interval: Annotated[
        int, D("LoRA: write adapters/step_N every N steps and at the final step (0 = off).", ge=0)
    ] = 0
    warm_start: Annotated[str | None, D("Initialise weights from this checkpoint or weights dir.")] = None
    warm_start_optimizer: Annotated[
        bool,
        D(
            "Also carry the warm-start checkpoint's optimizer state (AdamW moments) over; needs a "
            "complete checkpoint with a trainer part (not a bare weights dir) and the same LoRA shape."
        ),
    ] = False


class LogExtrasConfig(Section):
    interval: Annotated[int, D("Log sample tables and distributions every N steps.", ge=1)] = 10
    sample_ratio: Annotated[float, D("Fraction of samples in the tables.", gt=0, le=1)] = 0.1
    samples: Annotated[bool, D("Log prompt/completion tables.")] = True
    distributions: Annotated[bool, D("Log reward/advantage/entropy distributions.")] = True


class WandbConfig(Section):
    project: Annotated[str, D("W&B project.")] = "hpcrl"
    name: Annotated[str | None, D("W&B run name (default: the run name).")] = None
    entity: Annotated[str | None, D("W&B team/entity.")] = None
    group: Annotated[str | None, D("W&B run group (prime-rl's monitors.wandb.group).")] = None
    tags: Annotated[list[str] | None, D("W&B run tags.")] = None
    offline: Annotated[bool, D("Log offline (no network); sync later with `wandb sync`.")] = False
    log_extras: LogExtrasConfig = msgspec.field(default_factory=LogExtrasConfig)


class RoleWandbConfig(Section):
    """`trainer.wandb` / `orchestrator.wandb` (prime-rl's per-process W&B sections): both roles log into
    the one run [wandb] names, so only what each role logs is per role."""

    log_extras: Annotated[
        LogExtrasConfig | None,
        D("This role's sample tables / distributions; unset fields come from [wandb.log_extras]."),
    ] = None


class LogLevels(Section):
    """How much a command logs; every command's [log] has these (a training run's adds its console line)."""

    level: Annotated[
        Literal["debug", "info", "warning", "error"] | None,
        D("Log level (default $HPCRL_LOG_LEVEL, else $PRIME_LOG_LEVEL, else info)."),
    ] = None
    vf_level: Annotated[
        Literal["debug", "info", "warning", "error"],
        D("Env servers' and workers' log level, and verifiers' (logs/envs/...)."),
    ] = "info"


class LogConfig(LogLevels):
    console_interval: Annotated[int, D("Print one console line every N steps.", ge=1)] = 1


class RunLogConfig(LogConfig):
    """A training run's [log]: a role's [trainer.log] / [orchestrator.log] has no plots of its own."""

    plots: Annotated[
        bool,
        D(
            "Write PNG plots of metrics.jsonl into <output_dir>/plots/ when `hpcrl run` ends (about a "
            "CPU-second on the launching machine); `hpcrl plot DIR` writes them at any time."
        ),
    ] = True


class RendererConfig(Section):
    """prime-rl's renderer section (hpcrl.render.select; docs/renderers.md)."""

    name: Annotated[
        str,
        D(
            "Tokenization: auto (the renderers package's renderer for model.name, else default), default "
            "(the tokenizer's chat template), a renderer the package ships (qwen3, qwen3.5, glm-5, gpt-oss, "
            "...), or custom (import_path)."
        ),
    ] = "auto"
    import_path: Annotated[
        str | None, D("name = custom: the renderer class, 'module.Class' or 'path/file.py:Class'.")
    ] = None
    thinking_retention: Annotated[
        Literal["tool_cycle", "all"] | None,
        D(
            "Keep earlier turns' reasoning when bridging: tool_cycle (within a tool cycle; a new user "
            "query re-renders) or all; unset = what the renderer's template does."
        ),
    ] = None
    reasoning_parser: Annotated[
        str | None,
        D("The renderer's reasoning parser by the renderers package's name (unset: the renderer's own)."),
    ] = None
    tool_parser: Annotated[
        str | None, D("The renderer's tool-call parser by the renderers package's name (unset: its own).")
    ] = None
    clear_thinking: Annotated[
        bool | None,
        D(
            "GLM / MiniMax renderers: the chat template's clear_thinking toggle (unset: the renderer's default)."
        ),
    ] = None
    truncate_history_thinking: Annotated[
        bool | None,
        D(
            "Renderers with that template toggle (e.g. Nemotron): drop earlier turns' reasoning (unset: default)."
        ),
    ] = None
