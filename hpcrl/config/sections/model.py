"""Model sections, one per role: each role's `model` table holds only the fields that role reads.

    ModelConfig              the common part: name, dtype, trust_remote_code
    OrchestratorModelConfig  what the orchestrator reads (tokenizer): name, trust_remote_code
    InferenceModelConfig     common part + what a server reads (LoRA serving)
    TrainerModelConfig       common part + implementation, parallelism, memory, LoRA, precision

The top-level [model] is the shared table: a field set there flows into every role's section that
has it (a role's own value wins), so `[model] name = ...` reaches every role and `[model]
activation_checkpointing = true` reaches the trainer only (hpcrl.config.loader.flow_models).

The trainer's memory savers carry prime-rl's names and tables (`ac`, `ac_offloading`, `compile`,
`optim_cpu_offload`, `full_offload`, `quantization`); hpcrl's older booleans `activation_checkpointing`
and `activation_offload` are their shorthands (one implementation: hpcrl.trainer.memory_savers reads
the tables; ``__post_init__`` keeps the two views equal). prime-rl's other names and values for these
fields: hpcrl.config.prime_model.
"""

from __future__ import annotations

import re
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
    target_modules: Annotated[
        list[str], D("Module names LoRA adapts ('experts': a VL MoE's stacked experts, with [vlm]).")
    ] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


# prime-rl's selective activation-checkpointing targets (hpcrl.trainer.memory_savers says which a layer has)
AC_TARGETS = ("norm", "attn_proj", "mlp", "mla_up_proj", "routed_experts", "linear_attn")


class ActivationCheckpointConfig(Section):
    mode: Annotated[
        Literal["full", "selective"],
        D(
            "full: recompute whole decoder layers in backward (each keeps only its input); selective: "
            "recompute only the `targets` inside each chosen layer."
        ),
    ] = "full"
    freq: Annotated[int, D("Checkpoint every freq-th decoder layer (layers 0, freq, 2 freq, ...).", ge=1)] = 1
    targets: Annotated[
        list[str],
        D(
            "Selective mode: norm (every norm module), attn_proj (q/k/v/o projections and q/k norms), mlp "
            "(a dense MLP), routed_experts (a MoE layer's expert compute), linear_attn (Qwen3.5's gated "
            "delta net, a mamba mixer, a sliding-window attention); mla_up_proj and linear_attn name "
            "modules Qwen3 / Llama layers lack (refused when no chosen layer has them)."
        ),
    ] = msgspec.field(default_factory=lambda: ["norm"])

    def __post_init__(self) -> None:
        self.targets = list(dict.fromkeys(self.targets))
        unknown = [t for t in self.targets if t not in AC_TARGETS]
        if unknown:
            raise ValueError(f"unknown targets {unknown} (allowed: {', '.join(AC_TARGETS)})")
        if self.mode == "selective" and not self.targets:
            raise ValueError("selective activation checkpointing needs at least one target")


class ActivationOffloadingConfig(Section):
    pin_memory: Annotated[
        bool, D("Offloaded activations in pinned (page-locked) host memory (CUDA only; CPU: plain copies).")
    ] = True
    max_inflight_activations: Annotated[
        int,
        D(
            "The most recently offloaded activations also kept on the device: the first backward ops "
            "(which need the last-saved tensors) use them without waiting for a copy back.",
            ge=1,
        ),
    ] = 5


class CompileConfig(Section):
    fullgraph: Annotated[
        bool, D("Compile each decoder layer with fullgraph=True (no graph breaks allowed).")
    ] = False
    backend: Annotated[
        Literal["inductor", "aot_eager", "eager"],
        D("torch.compile backend (inductor: generated kernels; aot_eager: capture only, for debugging)."),
    ] = "inductor"


class FullOffloadConfig(Section):
    cpu_optimizer_backend: Annotated[
        Literal["native", "torch"],
        D("prime-rl's CPU optimizer kernel choice; hpcrl steps torch's optimizer (notes say so)."),
    ] = "native"
    numa_bind: Annotated[
        bool, D("prime-rl: pin each rank's CPUs to its GPU's NUMA node (notes say what here).")
    ] = True


class QuantizationConfig(Section):
    type: Annotated[
        Literal["fp8", "mxfp8"], D("Low-precision training matmuls (GPU kernels; notes say what here).")
    ] = "fp8"
    recipe: Annotated[
        Literal["mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp"], D("MXFP8 scaling recipe (type = mxfp8).")
    ] = "mxfp8_rceil"
    enable_grouped_gemm: Annotated[bool, D("Quantize the MoE experts' grouped GEMM too.")] = True
    enable_a2a: Annotated[bool, D("MXFP8: quantize the expert-parallel all-to-all.")] = True
    ignore_patterns: Annotated[list[str], D("Module name patterns kept in the compute dtype.")] = (
        msgspec.field(default_factory=lambda: ["lm_head", "router", r"mlp\.gate\.", "shared_expert_gate"])
    )


_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class VLMConfig(Section):
    """[model.vlm]: a vision-language model (prime-rl's VLMConfig); `hpcrl sft` and `hpcrl run` read it."""

    vision_encoder_attr: Annotated[
        str | None,
        D(
            "Dotted attribute path of the vision encoder in the model (e.g. model.visual); unset: the "
            "model type's (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, qwen3_5_moe: model.visual)."
        ),
    ] = None
    language_model_attr: Annotated[
        str | None,
        D(
            "Dotted attribute path of the language model (e.g. model.language_model); unset: the model type's."
        ),
    ] = None
    freeze_vision_encoder: Annotated[
        bool,
        D("Freeze the vision encoder: no gradients, no optimizer state (false: train it; not with LoRA)."),
    ] = True

    def __post_init__(self) -> None:
        for name in ("vision_encoder_attr", "language_model_attr"):
            v = getattr(self, name)
            if v is not None and not _DOTTED.match(v):
                raise ValueError(f"{name} = {v!r} is not a dotted attribute path (e.g. 'model.visual')")


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
            "Expert parallel degree (trainer, impl custom, MoE; with [vlm] any impl, a Qwen3-VL-MoE / Qwen3.5-MoE): "
            "experts sharded over groups of ep ranks, tokens dispatched with all-to-all; must divide the "
            "trainer ranks and the expert count.",
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
    ac: Annotated[
        ActivationCheckpointConfig | None,
        D("Activation checkpointing ([trainer.model.ac]: mode, freq, targets); unset: off."),
    ] = None
    activation_checkpointing: Annotated[
        bool, D("Shorthand: true = [ac] with its defaults (every decoder layer recomputed in backward).")
    ] = False
    ac_offloading: Annotated[
        ActivationOffloadingConfig | None,
        D(
            "Activation offloading: what the forward saves for backward (tensors of 1 KiB or more, not "
            "parameters) is copied to host memory and back when backward needs it; turns [ac] on."
        ),
    ] = None
    activation_offload: Annotated[bool, D("Shorthand: true = [ac_offloading] with its defaults.")] = False
    compile: Annotated[
        CompileConfig | None, D("torch.compile each decoder layer ([trainer.model.compile]); unset: eager.")
    ] = None
    optim_cpu_offload: Annotated[
        bool,
        D(
            "Optimizer state (e.g. AdamW's moments) in host memory between steps, moved to the device for "
            "each optimizer step; weights and gradients stay on the device."
        ),
    ] = False
    full_offload: Annotated[
        FullOffloadConfig | None,
        D(
            "prime-rl's full CPU optimizer offload (true or a table): here the optimizer state in host "
            "memory between steps (as optim_cpu_offload); excludes optim_cpu_offload."
        ),
    ] = None
    quantization: Annotated[
        QuantizationConfig | None,
        D("FP8 / MXFP8 training ([trainer.model.quantization]: type, recipe, ...)."),
    ] = None
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
    vlm: Annotated[
        VLMConfig | None,
        D(
            "A vision-language model ([model.vlm]): samples with images go through the model's own "
            "transformers class with their pixel values (one sample per micro-batch); unset: a text model."
        ),
    ] = None

    def __post_init__(self) -> None:
        # one setting, two views: a shorthand turns its table on, a table sets its shorthand;
        # offloading needs checkpointing (prime-rl turns it on)
        if self.activation_offload and self.ac_offloading is None:
            self.ac_offloading = ActivationOffloadingConfig()
        if (self.activation_checkpointing or self.ac_offloading is not None) and self.ac is None:
            self.ac = ActivationCheckpointConfig()
        self.activation_checkpointing = self.ac is not None
        self.activation_offload = self.ac_offloading is not None
        if self.optim_cpu_offload and self.full_offload is not None:
            raise ValueError(
                "optim_cpu_offload and full_offload exclude each other (set optim_cpu_offload = false)"
            )


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
