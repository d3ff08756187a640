"""Model and trainer sections: [model] (also restated per role), [trainer] with optim / loss / broadcast."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from hpcrl.config.sections.base import D, Section
from hpcrl.config.sections.common import LogConfig, RoleWandbConfig


class LoraConfig(Section):
    rank: Annotated[int, D("LoRA rank r.", ge=1)] = 16
    alpha: Annotated[float, D("LoRA alpha scaling factor.", gt=0)] = 16.0
    dropout: Annotated[float, D("LoRA dropout probability.", ge=0, le=1)] = 0.0
    target_modules: Annotated[list[str], D("Module names LoRA adapts.")] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


class ModelConfig(Section):
    name: Annotated[
        str | None,
        D("HF model id or local dir; built-ins hpcrl/tiny-qwen3 and hpcrl/small-qwen3 are made locally."),
    ] = None
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        D(
            "Weights dtype of inference; the trainer's compute dtype and the dtype of the policy it publishes "
            "(auto: bf16 on GPU, fp32 on CPU)."
        ),
    ] = "auto"
    optimization_dtype: Annotated[
        Literal["float32", "bfloat16"],
        D("Trainer: master weights and optimizer state (float32 under bf16 compute = bf16-mixed)."),
    ] = "float32"
    reduce_dtype: Annotated[
        Literal["float32", "bfloat16"], D("Trainer: dtype gradients are reduced in across ranks.")
    ] = "float32"
    attn: Annotated[
        Literal["auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3"],
        D("Attention implementation (auto: sdpa on CPU, flash-attn on GPU when installed)."),
    ] = "auto"
    impl: Annotated[
        Literal["hf", "custom", "auto"], D("Model implementation (hf transformers; custom accepted as hf).")
    ] = "auto"
    ep: Annotated[int, D("Expert parallel degree for MoE models (trainer).", ge=1)] = 1
    activation_checkpointing: Annotated[bool, D("Recompute activations in backward to save memory.")] = False
    trust_remote_code: Annotated[bool, D("Allow model code from the model directory.")] = False
    lora: Annotated[
        LoraConfig | None, D("Train a LoRA adapter instead of all weights (--model.lora enables).")
    ] = None
    # --- long fields ---
    logprobs_chunk_tokens: Annotated[
        int,
        D(
            "Trainer: positions per chunk of the LM head + log-softmax (logprobs, entropy, loss and backward "
            "chunk by chunk, no [tokens, vocab] tensor); 0 = all kept positions at once.",
            ge=0,
        ),
    ] = 256
    cp: Annotated[
        int, D("Trainer: context-parallel degree (a packed sequence split along time over cp ranks).", ge=1)
    ] = 1
    # --- end long fields ---


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
    kl_estimator: Annotated[Literal["k1", "k3"], D("KL estimator for the penalty.")] = "k3"


class BroadcastConfig(Section):
    transport: Annotated[
        Literal["auto", "filesystem", "collective"],
        D("How weights reach inference: collective (NCCL/gloo) or safetensors files; auto picks collective."),
    ] = "auto"
    chunk_mb: Annotated[int, D("Bucket size of the collective broadcast in MiB.", ge=1)] = 256
    timeout_s: Annotated[float, D("Seconds to wait for inference servers to load a policy.", gt=0)] = 300.0
    delta: Annotated[
        bool,
        D(
            "Send only the elements that changed since the previous policy (verified against the checksum of "
            "the full new weights); a full sync whenever the delta is not smaller."
        ),
    ] = False
    full_every: Annotated[int, D("With delta: a full sync every N policies (1 = always full).", ge=1)] = 20


class TrainerConfig(Section):
    model: Annotated[
        ModelConfig | None, D("Trainer-side model overrides (name must agree with [model]).")
    ] = None
    max_steps: Annotated[
        Annotated[int, Meta(ge=0)] | None, D("Shared: final training step (flows from top level).")
    ] = None
    seq_len: Annotated[
        Annotated[int, Meta(ge=8)] | None, D("Shared: max tokens per packed sample (flows from top level).")
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
    log: Annotated[LogConfig | None, D("Trainer log overrides.")] = None
    wandb: Annotated[
        RoleWandbConfig | None, D("Trainer W&B overrides (log_extras); needs W&B on ([wandb] or --wandb).")
    ] = None
