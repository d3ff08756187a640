"""Model sections, one per role: each role's `model` table holds only the fields that role reads.

    ModelConfig              the common part: name, dtype, trust_remote_code
    OrchestratorModelConfig  what the orchestrator reads (tokenizer): name, trust_remote_code
    InferenceModelConfig     common part + what a server reads (LoRA serving)
    TrainerModelConfig       common part + implementation, parallelism, memory, LoRA, precision

The top-level [model] is the shared table: a field set there flows into every role's section that
has it (a role's own value wins), so `[model] name = ...` reaches every role and `[model]
activation_checkpointing = true` reaches the trainer only (hpcrl.config.loader.flow_models).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from hpcrl.config.sections.base import MAX_GPU_MEMORY_GIB, D, Section

_NAME = D("HF model id or local dir; built-ins hpcrl/tiny-qwen3 and hpcrl/small-qwen3 are made locally.")
_TRUST = D("Allow model code from the model directory.")


class LoraConfig(Section):
    rank: Annotated[int, D("LoRA rank r.", ge=1)] = 16
    alpha: Annotated[float, D("LoRA alpha scaling factor.", gt=0)] = 16.0
    dropout: Annotated[float, D("LoRA dropout probability.", ge=0, le=1)] = 0.0
    target_modules: Annotated[list[str], D("Module names LoRA adapts.")] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


class OrchestratorModelConfig(Section):
    name: Annotated[str | None, _NAME] = None
    trust_remote_code: Annotated[bool, _TRUST] = False


class ModelConfig(Section):
    """The common part of every role's model section."""

    name: Annotated[str | None, _NAME] = None
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        D(
            "Weights dtype of inference; the trainer's compute dtype and the dtype of the policy it publishes "
            "(auto: bf16 on GPU, fp32 on CPU)."
        ),
    ] = "auto"
    trust_remote_code: Annotated[bool, _TRUST] = False


class InferenceModelConfig(ModelConfig):
    max_lora_rank: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        D(
            "Serve LoRA adapters up to this rank (vLLM starts with LoRA enabled); default: the rank of "
            "[trainer.model.lora] when the run trains LoRA."
        ),
    ] = None


class TrainerModelConfig(ModelConfig):
    optimization_dtype: Annotated[
        Literal["float32", "bfloat16"],
        D("Master weights and optimizer state (float32 under bf16 compute = bf16-mixed)."),
    ] = "float32"
    reduce_dtype: Annotated[
        Literal["float32", "bfloat16"], D("Dtype gradients are reduced in across ranks.")
    ] = "float32"
    attn: Annotated[
        Literal["auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3"],
        D("Attention implementation (auto: sdpa on CPU, flash-attn on GPU when installed)."),
    ] = "auto"
    impl: Annotated[
        Literal["hf", "custom", "auto"],
        D(
            "Trainer model implementation: hf (transformers), custom (hpcrl's own Qwen3 / Qwen3-MoE: stacked "
            "experts, grouped matmul, expert parallelism), auto (custom where one exists and no LoRA)."
        ),
    ] = "auto"
    ep: Annotated[
        int,
        D(
            "Expert parallel degree (trainer, impl custom, MoE): experts sharded over groups of ep ranks, tokens "
            "dispatched with all-to-all; must divide the trainer ranks and the expert count.",
            ge=1,
        ),
    ] = 1
    router_replay: Annotated[
        bool,
        D(
            "MoE RL, impl custom: route each sampled token to the experts the inference server routed it to "
            "(gate weights recomputed by the trainer, so its router still learns); off: the trainer routes freely."
        ),
    ] = True
    moe_aux_loss_coef: Annotated[
        float,
        D(
            "MoE: coefficient of the load-balancing loss (E * sum_e f_e * P_e, mean over layers; 0 = off).",
            ge=0,
        ),
    ] = 0.0
    activation_checkpointing: Annotated[bool, D("Recompute activations in backward to save memory.")] = False
    activation_offload: Annotated[
        bool,
        D(
            "CUDA: keep what each checkpointed decoder layer saves for its backward (its input) in pinned CPU "
            "memory, not on the GPU (torch save_on_cpu; needs activation_checkpointing). On CPU: no effect."
        ),
    ] = False
    logprobs_chunk_tokens: Annotated[
        int,
        D(
            "Positions per chunk of the LM head + log-softmax (logprobs, entropy, loss and backward chunk by "
            "chunk, no [tokens, vocab] tensor); 0 = all kept positions at once. An upper bound: "
            "logprobs_chunk_mib may take fewer.",
            ge=0,
        ),
    ] = 256
    logprobs_chunk_mib: Annotated[
        float,
        D(
            "Upper bound in MiB of a logprob chunk's fp32 [positions, vocab] buffer: a chunk has "
            "min(logprobs_chunk_tokens, this x 2^20 / (4 x vocab)) positions, at least 1 (32: 55 at "
            "vocab 151,936); 0 = no bound. Free on CPU; on a GPU chunks under ~256 positions re-read the "
            "LM head's weight too often (Qwen3-1.7B at 16k: 55 positions took 15 % longer a step).",
            ge=0,
            le=MAX_GPU_MEMORY_GIB * 1024,
        ),
    ] = 0.0
    cp: Annotated[
        int,
        D(
            "Context-parallel degree: a packed sequence split along time over cp ranks (ring attention).",
            ge=1,
        ),
    ] = 1
    cp_mode: Annotated[
        Literal["ring", "ulysses"],
        D(
            "How cp ranks attend over the whole row: 'ring' (key/value blocks gathered, log-sum-exp merge) "
            "or 'ulysses' (all-to-all over heads; cp must divide the attention heads)."
        ),
    ] = "ring"
    vocab_parallel: Annotated[
        bool,
        D(
            "Under cp: the input embedding and LM head are split over the vocabulary within each cp group "
            "(each rank holds vocab / cp rows, the group's hidden states travel instead); false: FSDP "
            "gathers the whole [vocab, hidden] weight and its gradient on every rank. The head then always "
            "runs in chunks. Not with LoRA on the embedding or head (they are then gathered whole)."
        ),
    ] = True
    lora: Annotated[
        LoraConfig | None, D("Train a LoRA adapter instead of all weights (--model.lora enables).")
    ] = None


ROLE_MODELS: dict[str, type[Section]] = {
    "trainer": TrainerModelConfig,
    "orchestrator": OrchestratorModelConfig,
    "inference": InferenceModelConfig,
}
"""Each role's model section type (the top-level [model] is a TrainerModelConfig: it holds every field)."""


def owners(field: str) -> list[str]:
    """The roles whose model section has `field` (for 'inference.model.ep: a trainer field')."""
    return [role for role, cls in ROLE_MODELS.items() if field in cls.__struct_fields__]


def owner_hint(path: str, key: str) -> str:
    """For `inference.model.ep`: the message naming the role that reads the field ('' otherwise)."""
    role, _, rest = path.partition(".")
    if rest != "model" or role not in ROLE_MODELS:
        return ""
    others = [r for r in owners(key) if r != role]
    if not others:
        return ""
    return (
        f"the {role} role does not read it; it is a {' / '.join(others)} field "
        f"(set it in [{others[0]}.model], or in [model] to reach every role that reads it)"
    )
