"""[inference] (the engine and its parallelism) and [server] (the HTTP front: address, key, guards)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from hpcrl.config.sections.base import D, Section
from hpcrl.config.sections.model import InferenceModelConfig


class InferenceParallelConfig(Section):
    tp: Annotated[int, D("Tensor parallel size inside each inference replica.", ge=1)] = 1
    dp: Annotated[int, D("Data parallel replicas per node.", ge=1)] = 1


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
    gpu_memory_utilization: Annotated[float, D("vLLM GPU memory fraction.", gt=0, le=1)] = 0.9
    parallel: InferenceParallelConfig = msgspec.field(default_factory=InferenceParallelConfig)
    seed: Annotated[int, D("Server RNG seed for requests without a seed.")] = 0
    enforce_eager: Annotated[bool, D("vLLM: disable CUDA graphs.")] = False


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
