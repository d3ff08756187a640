"""Typed config: one msgspec Struct per section; every field has a one-line description (its --help text).

Sections mirror prime-rl: model, trainer, orchestrator (train / eval / val / buffer / advantage / teacher),
inference, server, deployment, slurm, ckpt, wandb, log. Shared top-level fields (model.name, max_steps,
seq_len, output_dir) flow into the sections that restate them; conflicting explicit values are errors
(see hpcrl.config.loader). Unknown keys are rejected everywhere.

The sections live in hpcrl.config.sections, one module per role (trainer, orchestrator, inference,
deployment, common, and the sft / evaluation roots); this module holds the `hpcrl run` root and is where
every name is imported from.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from hpcrl.config.sections.base import D, Section
from hpcrl.config.sections.common import (
    CkptConfig,
    LogConfig,
    LogExtrasConfig,
    LogLevels,
    RendererConfig,
    RoleWandbConfig,
    RunLogConfig,
    WandbConfig,
)
from hpcrl.config.sections.deployment import DeploymentConfig, SlurmConfig
from hpcrl.config.sections.environ import EnvVars
from hpcrl.config.sections.evaluation import (
    ClientConfig,
    EvalInferenceConfig,
    EvalLogConfig,
    EvalRunConfig,
    GepaConfig,
    GepaRunConfig,
)
from hpcrl.config.sections.inference import InferenceConfig, InferenceParallelConfig, ServerConfig
from hpcrl.config.sections.model import (
    InferenceModelConfig,
    LoraConfig,
    ModelConfig,
    OrchestratorModelConfig,
    TrainerModelConfig,
)
from hpcrl.config.sections.orchestrator import (
    AdvantageConfig,
    BufferConfig,
    EnvConfig,
    EvalConfig,
    OrchestratorConfig,
    SamplingConfig,
    TeacherConfig,
    TrainEnvsConfig,
    ValConfig,
)
from hpcrl.config.sections.sft import LossMaskConfig, SFTConfig, SFTDataConfig, SFTValConfig
from hpcrl.config.sections.trainer import BroadcastConfig, LossConfig, OptimConfig, TrainerConfig

__all__ = [
    "SHARED_FIELDS",
    "AdvantageConfig",
    "BroadcastConfig",
    "BufferConfig",
    "CkptConfig",
    "ClientConfig",
    "Config",
    "D",
    "DeploymentConfig",
    "EnvConfig",
    "EvalConfig",
    "EvalInferenceConfig",
    "EvalLogConfig",
    "EvalRunConfig",
    "GepaConfig",
    "GepaRunConfig",
    "InferenceConfig",
    "InferenceModelConfig",
    "InferenceParallelConfig",
    "LogConfig",
    "RunLogConfig",
    "LogExtrasConfig",
    "RoleWandbConfig",
    "LogLevels",
    "LoraConfig",
    "LossConfig",
    "LossMaskConfig",
    "ModelConfig",
    "OptimConfig",
    "OrchestratorConfig",
    "OrchestratorModelConfig",
    "RendererConfig",
    "SFTConfig",
    "SFTDataConfig",
    "SFTValConfig",
    "SamplingConfig",
    "Section",
    "ServerConfig",
    "SlurmConfig",
    "TeacherConfig",
    "TrainEnvsConfig",
    "TrainerConfig",
    "TrainerModelConfig",
    "ValConfig",
    "WandbConfig",
]


class Config(Section):
    name: Annotated[str | None, D("Run name (default: the output dir's name).")] = None
    type: Annotated[
        Literal["rl", "full_finetune"], D("Run type; full_finetune is the hosted native shape.")
    ] = "rl"
    model: Annotated[
        TrainerModelConfig,
        D(
            "The shared model table: each field flows into every role's [<role>.model] that has it "
            "(name, dtype, trust_remote_code: all roles; the rest: the trainer); a role's own value wins."
        ),
    ] = msgspec.field(default_factory=TrainerModelConfig)
    max_steps: Annotated[
        int, D("Final training step (a resume runs up to it, not for that many more).", ge=0)
    ] = 20
    seq_len: Annotated[int, D("Max tokens per sample (prompt + completion).", ge=8)] = 512
    output_dir: Annotated[str, D("Run directory (checkpoints, logs, bus files).")] = "outputs/run"
    clean_output_dir: Annotated[bool, D("Delete output_dir before starting.")] = False
    seed: Annotated[int, D("Global seed (trainer, orchestrator and sampling derive from it).")] = 0
    deterministic: Annotated[
        bool,
        D("Deterministic mode: seeded sampling, fixed policy lag; resumes are bitwise identical on CPU."),
    ] = False
    watchdog_s: Annotated[
        float,
        D(
            "A role (trainer, orchestrator, inference server) that makes no progress for this many seconds is "
            "named in its log and exits 3, ending the job (0 = off).",
            ge=0,
        ),
    ] = 1800.0
    stall_warning_s: Annotated[
        float,
        D(
            "A role whose progress stops for this many seconds (or 3x its recent step time, if longer) "
            "says once, at WARNING, whom it waits on and since when, and writes Python stacks to "
            "logs/stalls/ (0 = off). Nothing ends: watchdog_s and the timeouts do that.",
            ge=0,
        ),
    ] = 60.0
    storage_timeout_s: Annotated[
        float,
        D(
            "A write the filesystem refuses (disk full, quota, read-only, I/O error) is named once, retried "
            "with backoff (1 s doubling to 30 s) for up to this many seconds, then ends the role in one line "
            "(every role: weight publish, checkpoints, bus, metrics; logs never end a role).",
            ge=0,
        ),
    ] = 600.0
    env_files: Annotated[
        list[str], D("Files of KEY=VALUE secrets loaded into the environment (never logged).")
    ] = msgspec.field(default_factory=list)
    env_vars: Annotated[
        EnvVars,
        D(
            "Environment variables of every process of the run (trainer.env_vars, orchestrator.env_vars and "
            "inference.env_vars override them for that role); values may be ${env:NAME} references."
        ),
    ] = msgspec.field(default_factory=dict)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    orchestrator: OrchestratorConfig = msgspec.field(default_factory=OrchestratorConfig)
    inference: InferenceConfig = msgspec.field(default_factory=InferenceConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    deployment: DeploymentConfig = msgspec.field(default_factory=DeploymentConfig)
    slurm: Annotated[SlurmConfig | None, D("SLURM settings for `hpcrl submit`.")] = None
    ckpt: Annotated[CkptConfig | None, D("Checkpointing (off unless --ckpt or a [ckpt] table).")] = None
    wandb: Annotated[WandbConfig | None, D("Weights & Biases (off unless --wandb or a [wandb] table).")] = (
        None
    )
    log: RunLogConfig = msgspec.field(default_factory=RunLogConfig)


SHARED_FIELDS = ("max_steps", "seq_len")
"""Top-level scalars that flow into sections that restate them (model.name handled separately)."""
