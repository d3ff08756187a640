"""The `hpcrl eval` and `hpcrl gepa` roots (hpcrl.evaluation): endpoint, self-started server, GEPA search."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from hpcrl.config.sections.base import D, Section
from hpcrl.config.sections.common import LogLevels, RendererConfig
from hpcrl.config.sections.orchestrator import EnvConfig, SamplingConfig


class ClientConfig(Section):
    base_url: Annotated[
        str | None,
        D(
            "OpenAI-compatible endpoint serving model.name (-b); unset: hpcrl starts `hpcrl inference` for the "
            "model and stops it afterwards."
        ),
    ] = None
    api_key_var: Annotated[str, D("Environment variable holding the endpoint's API key (sent when set).")] = (
        "OPENAI_API_KEY"
    )
    tokenizer: Annotated[
        str | None,
        D("Tokenizer dir or hub id for prompt lengths and multi-turn stitching (default: model.name)."),
    ] = None
    max_concurrent: Annotated[int, D("Requests in flight at once.", ge=1)] = 32
    timeout_s: Annotated[float, D("Timeout of one request.", gt=0)] = 600.0
    server_timeout_s: Annotated[float, D("Seconds to wait for a self-started inference server.", gt=0)] = (
        300.0
    )


class EvalInferenceConfig(Section):
    backend: Annotated[
        Literal["auto", "hf", "vllm"], D("auto: vllm on GPU when installed, else the embedded hf engine.")
    ] = "auto"
    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        D("Weights dtype (auto: fp32 on CPU, bf16 on GPU)."),
    ] = "auto"
    max_batch_size: Annotated[int, D("Max sequences decoded together.", ge=1)] = 64
    max_model_len: Annotated[
        Annotated[int, Meta(ge=8)] | None, D("Max context length (default: seq_len).")
    ] = None
    gpu_memory_utilization: Annotated[float, D("vLLM GPU memory fraction.", gt=0, le=1)] = 0.9
    tp: Annotated[int, D("vLLM tensor parallel size.", ge=1)] = 1
    trust_remote_code: Annotated[bool, D("Allow model/tokenizer code from the model directory.")] = False


class EvalLogConfig(LogLevels):
    """[log] of `hpcrl eval` / `hpcrl gepa`: the levels alone (no training steps to print)."""


class _PromptRunConfig(Section):
    """What `hpcrl eval` and `hpcrl gepa` share: the model, its endpoint, environments, sampling."""

    model: Annotated[
        str | None,
        D(
            "Model (-m): a local dir, a hub id, a run's weights/step_N, a built-in (hpcrl/tiny-qwen3), or the "
            "model name at client.base_url."
        ),
    ] = None
    env: Annotated[list[EnvConfig], D("Environments ([[env]]; positional ENV_IDs on the command line).")] = (
        msgspec.field(default_factory=list)
    )
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)
    renderer: Annotated[
        RendererConfig,
        D(
            "Tokenization (docs/renderers.md). Default: the endpoint's chat template, which any OpenAI "
            "server has; a typed renderer samples through /inference/v1/generate (hpcrl inference, vLLM "
            "with --enable-scale-out)."
        ),
    ] = msgspec.field(default_factory=lambda: RendererConfig(name="default"))
    client: ClientConfig = msgspec.field(default_factory=ClientConfig)
    inference: Annotated[
        EvalInferenceConfig, D("The self-started inference server (client.base_url unset).")
    ] = msgspec.field(default_factory=EvalInferenceConfig)
    seq_len: Annotated[
        int, D("Max tokens per rollout (prompt + completion); the self-started server's context.", ge=8)
    ] = 2048
    output_dir: Annotated[str | None, D("Where results go (default: outputs/<command>/<env>--<model>).")] = (
        None
    )
    seed: Annotated[
        int | None,
        D(
            "Sampling seed: every request's seed derives from it, the example and the rollout, so reruns and "
            "candidates see the same random draws (unset: the server's own randomness); sampling.seed wins."
        ),
    ] = 0
    log: EvalLogConfig = msgspec.field(default_factory=EvalLogConfig)


class EvalRunConfig(_PromptRunConfig):
    """`hpcrl eval`: score a model on environments (vf-eval's shape)."""

    num_examples: Annotated[int, D("Examples per environment (-n; -1 = all).", ge=-1)] = 5
    rollouts_per_example: Annotated[int, D("Rollouts per example (-r): the k of avg@k / pass@k.", ge=1)] = 3
    split: Annotated[Literal["eval", "train", "val"], D("Which split of each environment to evaluate.")] = (
        "eval"
    )
    pass_threshold: Annotated[float, D("A rollout passes when its reward is >= this (pass@k).")] = 0.99
    no_signal_threshold: Annotated[
        float,
        D(
            "Recommend changes when at least this fraction of examples got the same reward in all k rollouts.",
            ge=0,
            le=1,
        ),
    ] = 0.5


class GepaConfig(Section):
    reflection_model: Annotated[str | None, D("Model that proposes new prompts (-M; default: model).")] = None
    reflection_base_url: Annotated[
        str | None,
        D(
            "OpenAI-compatible endpoint of the reflection model (default: the task model's endpoint when the "
            "models are the same, else a self-started server)."
        ),
    ] = None
    reflection_api_key_var: Annotated[
        str, D("Environment variable holding the reflection endpoint's key.")
    ] = "OPENAI_API_KEY"
    reflection_max_tokens: Annotated[
        Annotated[int, Meta(ge=1)] | None, D("Max tokens of a reflection (unset: the endpoint's default).")
    ] = None
    reflection_temperature: Annotated[float, D("Sampling temperature of the reflection model.", ge=0)] = 1.0
    max_calls: Annotated[
        int,
        D("Budget (-B): rollouts the search may score, the base prompt's validation included; strict.", ge=1),
    ] = 500
    num_train: Annotated[int, D("Training examples minibatches are drawn from (-n).", ge=1)] = 100
    num_val: Annotated[int, D("Validation examples every accepted prompt is scored on (-N).", ge=1)] = 50
    minibatch_size: Annotated[int, D("Examples per reflection.", ge=1)] = 3
    perfect_score: Annotated[
        float | None, D("Max reward: a minibatch where the prompt already reaches it is not reflected on.")
    ] = None
    state_columns: Annotated[
        list[str],
        D("Extra fields shown to the reflection model per example: task info keys (or answer, metrics)."),
    ] = msgspec.field(default_factory=list)
    candidate_selection: Annotated[Literal["pareto", "current_best"], D("Which prompt to improve next.")] = (
        "pareto"
    )
    initial_prompt: Annotated[str | None, D("Seed prompt (default: the environment's system prompt).")] = None
    seed: Annotated[int, D("Seed of GEPA's own choices (minibatches, parents).")] = 0


class GepaRunConfig(_PromptRunConfig):
    """`hpcrl gepa run`: optimise an environment's system prompt with GEPA."""

    gepa: GepaConfig = msgspec.field(default_factory=GepaConfig)
