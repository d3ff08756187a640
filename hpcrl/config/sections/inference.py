"""[inference] (the engine and its parallelism) and [server] (the HTTP front: address, key, guards).

prime-rl's inference keys live here too: `vllm` (vLLM engine arguments, hpcrl.config.sections.vllm),
`env_vars`, `use_deep_gemm`, `enable_fp32_lm_head`, `enable_fp32_router_logits`, `kv_cache_offload`,
`deployment` and `router`; docs/inference.md says what each does here."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from hpcrl.config.sections.base import D, Section
from hpcrl.config.sections.environ import EnvVars
from hpcrl.config.sections.model import InferenceModelConfig
from hpcrl.config.sections.vllm import (
    InferenceDeploymentConfig,
    KVCacheOffloadConfig,
    RouterConfig,
    move_homes,
)


class InferenceParallelConfig(Section):
    tp: Annotated[int, D("Tensor parallel size inside each inference replica.", ge=1)] = 1
    dp: Annotated[
        int,
        D(
            "Engines per inference node (vLLM's data_parallel_size): hpcrl runs one server per tp GPUs, so on "
            "GPUs this must equal an inference node's GPUs / tp (1 = unstated).",
            ge=1,
        ),
    ] = 1


class InferenceConfig(Section):
    model: Annotated[
        InferenceModelConfig | None,
        D("The servers' model: [model]'s name, dtype, trust_remote_code, plus LoRA serving."),
    ] = None
    backend: Annotated[
        Literal["auto", "hf", "vllm"], D("auto: vllm on GPU when installed, else the embedded hf engine.")
    ] = "auto"
    max_batch_size: Annotated[int, D("Max sequences decoded together.", ge=1)] = 64
    max_model_len: Annotated[
        Annotated[int, Meta(ge=8)] | None, D("Max context length (default: seq_len).")
    ] = None
    kv_cache_tokens: Annotated[
        Annotated[int, Meta(ge=8)] | None,
        D(
            "hf engine: KV cache capacity in tokens, shared by the running sequences (beyond it requests "
            "queue and the youngest are preempted, as in vLLM; at least max_model_len). Unset: "
            "max_batch_size x max_model_len. vLLM sizes its own from gpu_memory_utilization."
        ),
    ] = None
    gpu_memory_utilization: Annotated[float, D("vLLM GPU memory fraction.", gt=0, le=1)] = 0.9
    parallel: InferenceParallelConfig = msgspec.field(default_factory=InferenceParallelConfig)
    seed: Annotated[int, D("Server RNG seed for requests without a seed.")] = 0
    enforce_eager: Annotated[bool, D("vLLM: disable CUDA graphs.")] = False
    quantization: Annotated[
        str | None,
        D(
            "Online quantization of the served policy (prime-rl #3031): fp8_per_block (128x128 blocks) or "
            "mxfp8, or another vLLM --quantization value; weight updates stay bf16 and are re-quantized "
            "layer by layer. The hf engine emulates the FP8 schemes (docs/fp8.md). None: as the checkpoint."
        ),
    ] = None
    vllm: Annotated[
        dict[str, Any],
        D(
            "vLLM engine arguments under vLLM's own names (`vllm serve --help`), handed to its parser when a vLLM "
            "server starts; a key that is an hpcrl field (tensor_parallel_size, max_model_len, ...) is its alias."
        ),
    ] = msgspec.field(default_factory=dict)
    env_vars: Annotated[
        EnvVars, D("Environment variables of the inference servers (over the top-level env_vars).")
    ] = msgspec.field(default_factory=dict)
    use_deep_gemm: Annotated[
        bool,
        D(
            "vLLM: DeepGEMM FP8 kernels (VLLM_USE_DEEP_GEMM / VLLM_MOE_USE_DEEP_GEMM = 1, else 0); block-wise "
            "FP8 models on Hopper GPUs only."
        ),
    ] = False
    enable_fp32_lm_head: Annotated[
        bool,
        D(
            "vLLM: the lm_head in fp32 (bf16 x bf16 -> fp32 GEMM) for exact logprobs (hf_overrides head_dtype)."
        ),
    ] = True
    enable_fp32_router_logits: Annotated[
        bool,
        D(
            "vLLM: fp32 MoE router logits where vLLM's model reads moe_router_dtype (DeepSeek family, GLM-5.x)."
        ),
    ] = True
    kv_cache_offload: Annotated[
        KVCacheOffloadConfig | None, D("vLLM: KV cache offload to CPU memory (and disk).")
    ] = None
    deployment: Annotated[
        InferenceDeploymentConfig,
        D("prime-rl's inference layout (single_node, multi_node, disaggregated prefill/decode)."),
    ] = msgspec.field(default_factory=InferenceDeploymentConfig)
    router: Annotated[
        RouterConfig | None, D("prime-rl's router in front of its engines (none runs here: see the docs).")
    ] = None

    def __post_init__(self) -> None:
        move_homes(self)  # [inference.vllm] keys that are hpcrl fields become those fields


class ServerConfig(Section):
    host: Annotated[str, D("Address the inference server binds.")] = "127.0.0.1"
    port: Annotated[int, D("Port of the first inference server (0 = pick a free one).", ge=0, le=65535)] = 0
    api_key: Annotated[
        str | None,
        D(
            "Bearer token every route but /health requires (like vLLM's --api-key; default $HPCRL_API_KEY, "
            "which `hpcrl run`/`submit` set to a fresh per-run token)."
        ),
    ] = None
    allow_open: Annotated[
        bool, D("Serve on a non-loopback address without an API key (refused otherwise).")
    ] = False
    allow_any_weights_path: Annotated[
        bool, D("Let /update_weights and /load_lora_adapter read outside the run directory.")
    ] = False
    control_timeout_s: Annotated[
        float,
        D(
            "Longest a control route waits on a peer before answering (/init_broadcaster's join of the "
            "trainer's weight group: 502 when nothing accepts at its address, 504 when it accepts but "
            "does not complete); a request's `join_timeout` overrides it.",
            gt=0,
            le=3600,
        ),
    ] = 8.0
