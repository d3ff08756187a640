"""[trainer] with optim / loss / broadcast (its model section: hpcrl.config.sections.model)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from hpcrl.config.sections.base import D, Section
from hpcrl.config.sections.common import LogConfig, RoleWandbConfig
from hpcrl.config.sections.environ import EnvVars
from hpcrl.config.sections.model import TrainerModelConfig
from hpcrl.errors import ConfigError

OptimType = Literal["adamw", "sgd", "muon", "sign_sgd"]

# The fields only some optimizers read, with each one's default (prime-rl's AdamWConfig, SGDConfig,
# MuonConfig; SignSGDConfig reads none). A field set for a type that does not read it is an error.
TYPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "betas1": {"adamw": 0.9, "muon": 0.9},
    "betas2": {"adamw": 0.999, "muon": 0.95},
    "eps": {"adamw": 1e-8, "muon": 1e-8},
    "mu": {"muon": 0.95},
    "momentum": {"sgd": 0.9},
    "nesterov": {"sgd": True},
}


class OptimConfig(Section):
    type: Annotated[
        OptimType,
        D(
            "adamw; sgd (momentum, nesterov); muon: Muon on hidden matrices, AdamW on embeddings, LM head "
            "and 1-D parameters; sign_sgd: p -= lr * sign(grad), stateless."
        ),
    ] = "adamw"
    lr: Annotated[float, D("Peak learning rate (0 = the weights never move: prime-rl allows it).", ge=0)] = (
        1e-5
    )
    weight_decay: Annotated[float, D("Decoupled weight decay (never on 1-D parameters).", ge=0)] = 0.0
    max_norm: Annotated[float, D("Clip the global gradient norm to this (0 = off).", ge=0)] = 1.0
    betas: Annotated[
        list[float] | None,
        D("Adam betas [b1, b2] (adamw; muon's AdamW part). Unset: [0.9, 0.999] adamw, [0.9, 0.95] muon."),
    ] = None
    betas1: Annotated[
        Annotated[float, Meta(ge=0, lt=1)] | None, D("prime-rl's name for betas[0] (adamw, muon).")
    ] = None
    betas2: Annotated[
        Annotated[float, Meta(ge=0, lt=1)] | None, D("prime-rl's name for betas[1] (adamw, muon).")
    ] = None
    eps: Annotated[
        Annotated[float, Meta(gt=0)] | None, D("Adam epsilon (adamw; muon: its AdamW part; unset: 1e-8).")
    ] = None
    mu: Annotated[
        Annotated[float, Meta(ge=0, lt=1)] | None, D("Muon's momentum factor (muon; unset: 0.95).")
    ] = None
    momentum: Annotated[
        Annotated[float, Meta(ge=0, lt=1)] | None, D("SGD momentum factor (sgd; unset: 0.9).")
    ] = None
    nesterov: Annotated[bool | None, D("Nesterov momentum (sgd; unset: true, false when momentum = 0).")] = (
        None
    )
    scheduler: Annotated[Literal["constant", "linear", "cosine"], D("LR schedule after warmup.")] = "constant"
    warmup_steps: Annotated[int, D("Linear warmup steps.", ge=0)] = 0
    min_lr_ratio: Annotated[float, D("Final lr as a fraction of lr for linear/cosine decay.", ge=0, le=1)] = (
        0.0
    )

    def check(self, path: str) -> None:
        """Refuse a field the chosen type does not read, and betas that disagree (ConfigError at
        ``path``.field)."""
        for name, per_type in TYPE_DEFAULTS.items():
            if getattr(self, name) is not None and self.type not in per_type:
                users = " or ".join(repr(t) for t in per_type)
                raise ConfigError(f"{path}.{name}", f"applies to type = {users} only, not {self.type!r}")
        if self.betas is not None:
            if self.type not in TYPE_DEFAULTS["betas1"]:
                raise ConfigError(
                    f"{path}.betas", f"applies to type = 'adamw' or 'muon' only, not {self.type!r}"
                )
            if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
                raise ConfigError(f"{path}.betas", f"{self.betas} is not two numbers in [0, 1)")
            for i, name in enumerate(("betas1", "betas2")):
                own = getattr(self, name)
                if own is not None and own != self.betas[i]:
                    raise ConfigError(
                        f"{path}.{name}",
                        f"{own} conflicts with betas[{i}] = {self.betas[i]} (the same setting)",
                    )
        if self.type == "sgd" and self.nesterov and self.momentum == 0:
            raise ConfigError(f"{path}.nesterov", f"needs momentum > 0 ({path}.momentum is 0)")

    def settings(self) -> dict[str, Any]:
        """The type-specific settings the chosen optimizer reads: what is set, else its default."""
        out = {
            name: per_type[self.type] if getattr(self, name) is None else getattr(self, name)
            for name, per_type in TYPE_DEFAULTS.items()
            if self.type in per_type
        }
        if self.betas is not None:
            out["betas1"], out["betas2"] = self.betas
        if self.type == "sgd" and self.nesterov is None:
            out["nesterov"] = out["momentum"] > 0
        return out


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
    # Rollout mismatch correction (hpcrl.trainer.loss, docs/fp8.md): r = p_trainer / p_sampler per token.
    use_tis: Annotated[
        bool,
        D(
            "Truncated importance sampling (slime's use_tis): each token's detached IS weight is "
            "min(r, tis_clip); recommended with inference.quantization."
        ),
    ] = False
    tis_clip: Annotated[float, D("TIS cap C on the trainer/sampler ratio (slime's tis_clip).", gt=0)] = 2.0
    token_mask_low: Annotated[
        Annotated[float, Meta(gt=0)] | None, D("MIS: mask a token whose ratio is below this (None = off).")
    ] = None
    token_mask_high: Annotated[
        Annotated[float, Meta(gt=0)] | None, D("MIS: mask a token whose ratio is above this (None = off).")
    ] = None
    sequence_mask_low: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        D("MIS: mask a whole sample when any of its tokens' ratio is below this (None = off)."),
    ] = None
    sequence_mask_high: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        D("MIS: mask a whole sample when any of its tokens' ratio is above this (None = off)."),
    ] = None
    geo_mask_low: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        D("MIS: mask a whole sample whose geometric-mean ratio is below this (None = off)."),
    ] = None
    geo_mask_high: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        D("MIS: mask a whole sample whose geometric-mean ratio is above this (None = off)."),
    ] = None

    def check(self, path: str) -> None:
        """low < high for each mask (ConfigError naming the pair)."""
        for level in ("token", "sequence", "geo"):
            lo, hi = getattr(self, f"{level}_mask_low"), getattr(self, f"{level}_mask_high")
            if lo is not None and hi is not None and lo >= hi:
                raise ConfigError(f"{path}.{level}_mask_low", f"{lo} must be < {level}_mask_high ({hi})")


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


class FakeDataConfig(Section):
    """prime-rl's [trainer.data.fake]: the trainer alone on made-up batches (hpcrl.trainer.rl_fake)."""

    batch_size: Annotated[
        int, D("Rows of seq_len tokens per step, over all ranks (each rank trains batch_size / ranks).", ge=1)
    ] = 2
    generate_samples: Annotated[
        bool,
        D("Pack each row with samples of seeded random lengths (1 to seq_len / 8) instead of one sample."),
    ] = False


class TrainerDataConfig(Section):
    fake: Annotated[
        FakeDataConfig | None,
        D(
            "Train on seeded random tokens of the configured shape, with no orchestrator and no weight "
            "broadcast (`hpcrl trainer` alone: throughput benchmarking). Unset: batches from the bus."
        ),
    ] = None


class TrainerConfig(Section):
    model: Annotated[
        TrainerModelConfig | None,
        D("The trainer's model: [model]'s fields plus its own (impl, attn, ep, LoRA, precision, memory)."),
    ] = None
    max_steps: Annotated[
        Annotated[int, Meta(ge=0)] | None, D("Shared: final training step (flows from top level).")
    ] = None
    optim: OptimConfig = msgspec.field(default_factory=OptimConfig)
    data: TrainerDataConfig = msgspec.field(default_factory=TrainerDataConfig)
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
    dist_timeout_seconds: Annotated[
        int, D("Timeout of the trainer's torch.distributed collectives, in seconds.", ge=1)
    ] = 3600
    enable_token_export: Annotated[
        bool,
        D(
            "Write every trained sample's tokens with the trainer's numbers for them (logprobs, entropy, "
            "importance ratio, mismatch KL, masked) to token_exports/step_N/rank_R.jsonl, STABLE when complete."
        ),
    ] = False
    env_vars: Annotated[
        EnvVars, D("Environment variables of the trainer ranks (over the top-level env_vars).")
    ] = msgspec.field(default_factory=dict)
    wandb: Annotated[
        RoleWandbConfig | None, D("Trainer W&B overrides (log_extras); needs W&B on ([wandb] or --wandb).")
    ] = None
