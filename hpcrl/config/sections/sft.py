"""The `hpcrl sft` root: [data], [loss_mask], [val] and the SFTConfig that holds them."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from hpcrl.config.sections.base import D, Section
from hpcrl.config.sections.common import CkptConfig, LogConfig, RendererConfig, WandbConfig
from hpcrl.config.sections.deployment import DeploymentConfig, SlurmConfig
from hpcrl.config.sections.environ import EnvVars
from hpcrl.config.sections.sft_eval import SFTEvalConfig
from hpcrl.config.sections.trainer import OptimConfig
from hpcrl.config.sections.vlm import SFTModelConfig


class SFTDataConfig(Section):
    type: Annotated[
        Literal["sft", "fake"],
        D(
            "sft: the rows of data.name; fake: prime-rl's made-up token rows (length, input_ids), to measure the trainer."
        ),
    ] = "sft"
    name: Annotated[str, D("Local jsonl/parquet file, a directory of them, or a saved HF datasets dir.")] = ""
    split: Annotated[str, D("Split for saved dataset dicts.")] = "train"
    batch_size: Annotated[
        int,
        D(
            "Per optimizer step: samples (data.batch_unit = samples, the default), or tokens "
            "(batch_unit = tokens: prime-rl's meaning, rows packed up to this many tokens).",
            ge=1,
        ),
    ] = 32
    batch_unit: Annotated[
        Literal["samples", "tokens"],
        D(
            "What data.batch_size counts: samples (rows per step) or tokens (rows are taken in order "
            "until their tokens reach batch_size; prime-rl's 'tokens per trainer step (packed)')."
        ),
    ] = "samples"
    seq_len: Annotated[
        Annotated[int, Meta(ge=8)] | None, D("Packed row length (default: top-level seq_len).")
    ] = None
    length: Annotated[
        Literal["fixed", "variable"],
        D("type = fake: rows of seq_len tokens, or a seeded length in [2, seq_len)."),
    ] = "fixed"
    input_ids: Annotated[
        Literal["increasing", "random"],
        D("type = fake: row i is all token i (mod vocab), or seeded random ids."),
    ] = "increasing"
    shuffle: Annotated[bool, D("Shuffle each epoch (seeded).")] = True
    seed: Annotated[int, D("Shuffle seed.")] = 0
    enable_thinking: Annotated[
        bool | None,
        D("Chat-template thinking switch for every rendered turn (a row's own chat_template_kwargs win)."),
    ] = None
    reasoning_effort: Annotated[
        Literal["low", "medium", "high"] | None,
        D("Chat-template reasoning effort for every rendered turn (GPT-OSS; a row's own kwargs win)."),
    ] = None


class LossMaskConfig(Section):
    system: Annotated[bool, D("Train on system turns.")] = False
    user: Annotated[bool, D("Train on user turns.")] = False
    assistant: Annotated[bool, D("Train on assistant turns.")] = True
    tool: Annotated[bool, D("Train on tool turns.")] = False


class SFTValConfig(Section):
    interval: Annotated[int, D("Validation loss every N steps (0 = off).", ge=0)] = 0
    data: Annotated[SFTDataConfig | None, D("Validation data (mirrors [data]).")] = None
    fraction: Annotated[float, D("Hold out this fraction of [data] when val.data is unset.", ge=0, lt=1)] = (
        0.05
    )
    stop_at_loss: Annotated[
        float,
        D(
            "Stop (and save weights, with [ckpt]) once the validation loss is <= this; 0 = off. A warm-up "
            "that ends at a level of skill, not at a step count.",
            ge=0,
        ),
    ] = 0.0


class SFTConfig(Section):
    name: Annotated[str | None, D("Run name.")] = None
    model: SFTModelConfig = msgspec.field(default_factory=SFTModelConfig)
    max_steps: Annotated[int, D("Final optimizer step.", ge=0)] = 100
    seq_len: Annotated[int, D("Max tokens per packed row.", ge=8)] = 512
    output_dir: Annotated[str, D("Run directory.")] = "outputs/sft"
    clean_output_dir: Annotated[bool, D("Delete output_dir before starting.")] = False
    seed: Annotated[int, D("Global seed.")] = 0
    watchdog_s: Annotated[
        float,
        D(
            "A trainer rank that makes no progress (no step, no checkpoint) for this many seconds is named "
            "in its log and exits 3, ending the run (0 = off); `hpcrl sft ... --ckpt.resume-step -1` goes on.",
            ge=0,
        ),
    ] = 1800.0
    stall_warning_s: Annotated[
        float,
        D(
            "A trainer rank whose progress stops for this many seconds (or 3x its recent step time, if "
            "longer) says once, at WARNING, where it waits, and writes Python stacks to logs/stalls/ "
            "(0 = off). Nothing ends: watchdog_s does that.",
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
    data: SFTDataConfig = msgspec.field(default_factory=SFTDataConfig)
    loss_mask: LossMaskConfig = msgspec.field(default_factory=LossMaskConfig)
    renderer: Annotated[
        RendererConfig,
        D(
            "Tokenization and loss masks: a typed renderer builds each sample with the renderers package's "
            "training-sample builder (think-stripping templates included); default keeps hpcrl's "
            "incremental chat-template rendering (docs/renderers.md)."
        ),
    ] = msgspec.field(default_factory=RendererConfig)
    val: SFTValConfig = msgspec.field(default_factory=SFTValConfig)
    eval: Annotated[
        SFTEvalConfig | None,
        D("Online evaluation on environments during training (prime-rl's SFT [eval]; unset: none)."),
    ] = None
    optim: OptimConfig = msgspec.field(default_factory=lambda: OptimConfig(lr=1e-3))
    micro_batch_tokens: Annotated[int, D("Tokens per micro-batch.", ge=8)] = 4096
    dist_timeout_seconds: Annotated[
        int, D("Timeout of the trainer's torch.distributed collectives, in seconds.", ge=1)
    ] = 3600
    peak_tflops: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        D("Peak TFLOP/s of one device, for perf/mfu (unset: from the GPU's name; on CPU no perf/mfu)."),
    ] = None
    deployment: DeploymentConfig = msgspec.field(default_factory=DeploymentConfig)
    ckpt: Annotated[CkptConfig | None, D("Checkpointing.")] = None
    env_vars: Annotated[
        EnvVars,
        D("Environment variables of every trainer rank (prime-rl's SFT env_vars); ${env:NAME} allowed."),
    ] = msgspec.field(default_factory=dict)
    slurm: Annotated[
        SlurmConfig | None,
        D("SLURM settings for `hpcrl submit` of this SFT config (nodes: deployment.num_train_nodes)."),
    ] = None
    wandb: Annotated[WandbConfig | None, D("Weights & Biases.")] = None
    log: LogConfig = msgspec.field(default_factory=LogConfig)
