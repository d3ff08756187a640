"""[trainer] with optim / loss / broadcast (its model section: hpcrl.config.sections.model)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from hpcrl.config.sections.base import D, Section
from hpcrl.config.sections.common import LogConfig, RoleWandbConfig
from hpcrl.config.sections.model import TrainerModelConfig


class OptimConfig(Section):
    type: Annotated[Literal["adamw", "sgd"], D("Optimizer.")] = "adamw"
    lr: Annotated[float, D("Peak learning rate.", gt=0)] = 1e-5
    weight_decay: Annotated[float, D("Decoupled weight decay.", ge=0)] = 0.0
    betas: Annotated[list[float], D("Adam betas [b1, b2].")] = msgspec.field(
        default_factory=lambda: [0.9, 0.999]
    )
    eps: Annotated[float, D("Adam epsilon.", gt=0)] = 1e-8
    max_norm: Annotated[float, D("Clip the global gradient norm to this (0 = off).", ge=0)] = 1.0
    scheduler: Annotated[Literal["constant", "linear", "cosine"], D("LR schedule after warmup.")] = "constant"
    warmup_steps: Annotated[int, D("Linear warmup steps.", ge=0)] = 0
    min_lr_ratio: Annotated[float, D("Final lr as a fraction of lr for linear/cosine decay.", ge=0, le=1)] = (
        0.0
    )


class LossConfig(Section):
    type: Annotated[
        Literal["default", "cispo"], D("default: trust-region token masking; cispo: clipped IS weight.")
    ] = "default"
    eps_low: Annotated[
        float, D("Lower trust region: ratio < 1-eps_low masked for negative advantages.", ge=0, le=1)
    ] = 0.2
    eps_high: Annotated[
        float, D("Upper trust region: ratio > 1+eps_high masked for positive advantages.", ge=0)
    ] = 0.28
    max_log_ratio: Annotated[float, D("Clamp |log ratio| to this before exp (numerical safety).", gt=0)] = (
        20.0
    )
    kl_coef: Annotated[float, D("Coefficient of the KL penalty term (0 = off).", ge=0)] = 0.0
    entropy_coef: Annotated[
        float,
        D(
            "Entropy bonus (rl mode): coef * -log p(token) is added to each token's advantage, whose "
            "policy gradient is coef * the entropy's gradient in expectation (0 = off).",
            ge=0,
        ),
    ] = 0.0
    kl_estimator: Annotated[Literal["k1", "k3"], D("KL estimator for the penalty.")] = "k3"


class BroadcastConfig(Section):
    transport: Annotated[
        Literal["auto", "filesystem", "collective"],
        D(
            "How weights reach inference: collective (NCCL/gloo, every trainer rank sends its own pieces) "
            "or safetensors files; auto: collective on GPUs, files on CPU or with delta."
        ),
    ] = "auto"
    chunk_mb: Annotated[
        int,
        D(
            "Collective: MiB of one round at a receiver. All trainer ranks send at once, each a bucket of at "
            "most chunk_mb / ranks per round; every receiving GPU holds 2 rounds (outside vLLM's "
            "gpu_memory_utilization pool: the dry run checks it).",
            ge=1,
        ),
    ] = 256
    timeout_s: Annotated[float, D("Seconds to wait for inference servers to load a policy.", gt=0)] = 300.0
    delta: Annotated[
        bool,
        D(
            "Send only the elements that changed since the previous policy (verified against the checksum of "
            "the full new weights); a full sync whenever the delta is not smaller. Files and the hf "
            "engine only: refused with transport = collective and with inference.backend = vllm."
        ),
    ] = False
    full_every: Annotated[int, D("With delta: a full sync every N policies (1 = always full).", ge=1)] = 20
    sharded: Annotated[
        bool,
        D(
            "No rank gathers the policy. Filesystem: every trainer rank writes only its own rows of each "
            "tensor into broadcasts/step_N/ (files of bucket_mb) and rank 0 writes manifest.json last. "
            "Collective: every trainer rank sends its own rows, all at once, in rounds of chunk_mb, each "
            "part verified where it lands. false: every rank gathers the whole policy (the old path). LoRA adapters after "
            "the first policy still take the gathered path (small)."
        ),
    ] = True
    bucket_mb: Annotated[
        int,
        D(
            "Filesystem: MiB of pieces a rank holds on the host and writes per file (one bucket; its largest "
            "cast piece is on the GPU).",
            ge=1,
        ),
    ] = 256


class TrainerConfig(Section):
    model: Annotated[
        TrainerModelConfig | None,
        D("The trainer's model: [model]'s fields plus its own (impl, attn, ep, LoRA, precision, memory)."),
    ] = None
    max_steps: Annotated[
        Annotated[int, Meta(ge=0)] | None, D("Shared: final training step (flows from top level).")
    ] = None
    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)
    loss: LossConfig = msgspec.field(default_factory=LossConfig)
    broadcast: BroadcastConfig = msgspec.field(default_factory=BroadcastConfig)
    micro_batch_tokens: Annotated[int, D("Tokens per forward/backward micro-batch (packed row).", ge=8)] = (
        4096
    )
    share_prefix: Annotated[
        bool,
        D(
            "Compute a prefix shared by consecutive samples (a prompt's n completions) once per micro-batch; "
            "exact. Masked attention kernels only (sdpa/eager: CPU); flash-attention runs samples in full."
        ),
    ] = True
    batch_timeout_s: Annotated[float, D("Seconds to wait for a rollout batch before failing.", gt=0)] = 1800.0
    seed: Annotated[int, D("Trainer RNG seed.")] = 0
    peak_tflops: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        D("Peak TFLOP/s of one device, for perf/mfu (unset: from the GPU's name; on CPU no perf/mfu)."),
    ] = None
    log: Annotated[LogConfig | None, D("Trainer log overrides.")] = None
    wandb: Annotated[
        RoleWandbConfig | None, D("Trainer W&B overrides (log_extras); needs W&B on ([wandb] or --wandb).")
    ] = None
