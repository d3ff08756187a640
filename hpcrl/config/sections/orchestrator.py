"""[orchestrator]: sampling, environments, eval / val, buffer, algo (advantage, teacher), renderer."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from hpcrl.config.sections.algo import AlgoConfig, AlgoSamplingConfig, FrozenModelConfig, LengthPenaltyConfig
from hpcrl.config.sections.base import D, Section
from hpcrl.config.sections.common import LogConfig, RendererConfig, RoleWandbConfig
from hpcrl.config.sections.concurrency import ConcurrencyConfig
from hpcrl.config.sections.environ import EnvVars
from hpcrl.config.sections.model import OrchestratorModelConfig


class SamplingConfig(Section):
    max_tokens: Annotated[int, D("Max new tokens per model turn (alias max_completion_tokens).", ge=1)] = 128
    temperature: Annotated[float, D("Sampling temperature.", ge=0)] = 1.0
    top_p: Annotated[float, D("Nucleus sampling mass.", gt=0, le=1)] = 1.0
    top_k: Annotated[int, D("Top-k sampling (-1 = off).", ge=-1)] = -1
    min_p: Annotated[float, D("Min-p sampling (0 = off).", ge=0, le=1)] = 0.0
    repetition_penalty: Annotated[float, D("Repetition penalty (1 = off).", gt=0)] = 1.0
    seed: Annotated[
        int | None, D("Base sampling seed; per-request seeds derive from it (deterministic mode).")
    ] = None
    enable_thinking: Annotated[
        bool | None, D("Toggle thinking mode in the chat template (Qwen3.5, Nemotron).")
    ] = None
    reasoning_effort: Annotated[Literal["low", "medium", "high"] | None, D("Reasoning effort (GPT-OSS).")] = (
        None
    )
    extra_body: Annotated[
        dict[str, Any],
        D(
            "More fields sent with every model turn (prime-rl's extra_body): inference-server sampling "
            "parameters, and `chat_template_kwargs`, which also render the orchestrator's own prompts. "
            "Fields set above are refused here."
        ),
    ] = msgspec.field(default_factory=dict)


class EnvConfig(Section):
    id: Annotated[str, D("Environment id: built-in name, owner/name, python module or module:function.")]
    name: Annotated[str | None, D("Display name in metrics and logs (default: last part of id).")] = None
    args: Annotated[dict[str, Any], D("Keyword arguments for load_environment().")] = msgspec.field(
        default_factory=dict
    )
    ratio: Annotated[
        Annotated[float, Meta(gt=0)] | None, D("Relative share of this env's tasks in a batch.")
    ] = None
    num_examples: Annotated[Annotated[int, Meta(ge=-1)] | None, D("Examples to use (-1 or unset = all).")] = (
        None
    )
    rollouts_per_example: Annotated[
        Annotated[int, Meta(ge=1)] | None, D("Eval only: rollouts per example for this env.")
    ] = None
    workers: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        D(
            "Worker processes of this env's server (unset: orchestrator.env_workers; 0 = run the env "
            "inside the orchestrator, the old in-process path)."
        ),
    ] = None
    rollout_timeout_s: Annotated[
        float,
        D("A rollout spending longer than this in env code (not waiting for the model) is killed.", gt=0),
    ] = 600.0
    runtime: Annotated[
        str | None,
        D(
            "verifiers 0.4 (v1) envs: the runtime every seat's harness runs in, by verifiers' name: "
            "subprocess, docker, podman, apptainer, or hosted prime, modal, e2b (unset: the env's own "
            "default; a hosted default runs in subprocess on hpcrl's nodes, with a note)."
        ),
    ] = None
    env: Annotated[
        dict[str, Any],
        D(
            "verifiers 0.4 (v1) envs: verifiers' own env config table (prime-rl's source.env: taskset, "
            "agent.harness / runtime / timeout, seats), handed to verifiers unchanged; args add taskset fields."
        ),
    ] = msgspec.field(default_factory=dict)
    algo: Annotated[
        AlgoConfig | None,
        D(
            "Train envs: this env's own algorithm (prime-rl's per-source algo; unset: orchestrator.algo). "
            "rl types and opd / opsd mix in one run: docs/algorithms.md."
        ),
    ] = None


class TrainEnvsConfig(Section):
    env: Annotated[list[EnvConfig], D("Training environments ([[orchestrator.train.env]]).")] = msgspec.field(
        default_factory=list
    )
    sampling: SamplingConfig = msgspec.field(default_factory=SamplingConfig)


class EvalConfig(Section):
    interval: Annotated[int, D("Evaluate every N training steps (0 = off).", ge=0)] = 100
    num_examples: Annotated[int, D("Eval examples per env (-1 = all).", ge=-1)] = -1
    rollouts_per_example: Annotated[int, D("Rollouts per eval example (k of avg@k / pass@k).", ge=1)] = 1
    eval_base_model: Annotated[bool, D("Also evaluate the base model before training.")] = True
    env: Annotated[list[EnvConfig], D("Eval environments ([[orchestrator.eval.env]]).")] = msgspec.field(
        default_factory=list
    )
    sampling: Annotated[
        SamplingConfig | None, D("Eval sampling (default: train sampling, temperature kept).")
    ] = None


class ValConfig(Section):
    interval: Annotated[int, D("Validate every N steps (0 = off).", ge=0)] = 5
    num_examples: Annotated[int, D("Validation examples per check.", ge=1)] = 64
    rollouts_per_example: Annotated[int, D("Rollouts per validation example.", ge=1)] = 1


class BufferConfig(Section):
    online_difficulty_filtering: Annotated[bool, D("Drop groups the model finds too easy or too hard.")] = (
        False
    )
    easy_threshold: Annotated[float, D("Group mean reward above this is easy.")] = 0.8
    hard_threshold: Annotated[float, D("Group mean reward below this is hard.")] = 0.2
    easy_fraction: Annotated[float, D("Fraction of easy groups kept.", ge=0, le=1)] = 0.0
    hard_fraction: Annotated[float, D("Fraction of hard groups kept.", ge=0, le=1)] = 0.0
    env_ratios: Annotated[list[float] | None, D("Task share per training env (multi-env).")] = None
    seed: Annotated[int, D("Seed of the buffer's sampling decisions.")] = 42


class AdvantageConfig(Section):
    """hpcrl's own knobs of the reward-based algorithms (orchestrator.algo type grpo, max_rl, rae, echo)."""

    std_normalize: Annotated[
        bool, D("grpo / echo: divide the group-centred advantages by their std (GRPO; off = Dr. GRPO).")
    ] = False
    length_penalty: Annotated[
        float,
        D(
            "Older name: c > 0 sets [orchestrator.algo.length_penalty] with num_output_tokens_weight = c "
            "and the other weights 0 (0 = off).",
            ge=0,
        ),
    ] = 0.0
    reward_clip: Annotated[
        Annotated[float, Meta(gt=0)] | None,
        D("Clip every reward into [-c, c] before advantages (metrics keep the raw rewards; unset = off)."),
    ] = None
    zero_advantage: Annotated[
        Literal["keep", "drop"],
        D(
            "Groups whose rewards are all equal: keep, or drop and generate replacements (after 16 rounds "
            "that leave the batch short, it is filled with dropped groups, advantage 0, and a warning)."
        ),
    ] = "drop"


class TeacherConfig(Section):
    """Older name: training_mode = 'opd' makes it [orchestrator.algo.teacher], 'sft' the sampling source."""

    base_url: Annotated[str, D("OpenAI-compatible endpoint of the teacher (opd / sft modes).")]
    model: Annotated[str | None, D("Teacher model name at that endpoint.")] = None
    api_key_var: Annotated[str, D("Environment variable holding the teacher's API key.")] = "OPENAI_API_KEY"


class SaveRolloutsConfig(Section):
    """[orchestrator.save_rollouts]: every rollout under rollouts/step_N/{train,eval}/ (issue 51)."""

    enabled: Annotated[
        bool, D("Save every train and eval rollout in full under rollouts/step_N/{train,eval}/traces.jsonl.")
    ] = True
    keep_last: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        D("Keep the newest K steps' saved rollouts (unset: ckpt.keep_last x ckpt.interval steps, else all)."),
    ] = None
    tokens: Annotated[
        bool, D("Also save each turn's sampled token ids, logprobs and token texts (token colouring).")
    ] = True


class OrchestratorConfig(Section):
    model: Annotated[
        OrchestratorModelConfig | None,
        D("The orchestrator's model (its tokenizer): name, trust_remote_code."),
    ] = None
    max_steps: Annotated[Annotated[int, Meta(ge=0)] | None, D("Shared: final training step.")] = None
    batch_size: Annotated[
        int, D("Rollouts per training step (a multiple of rollouts_per_example).", ge=1)
    ] = 128
    rollouts_per_example: Annotated[int, D("Completions per task (group size, alias group_size).", ge=1)] = 8
    max_async_level: Annotated[int, D("Steps the orchestrator may run ahead of the newest policy.", ge=0)] = 1
    max_off_policy_steps: Annotated[
        int, D("Drop a sample whose oldest token is this many policies old.", ge=0)
    ] = 8
    oversampling_factor: Annotated[float, D("Request this many times the tasks a batch needs.", ge=1)] = 1.0
    training_mode: Annotated[
        Literal["rl", "opd", "sft"] | None,
        D("Older name of orchestrator.algo.type: rl = grpo, opd, sft (teacher from [orchestrator.teacher])."),
    ] = None
    trajectory_strategy: Annotated[
        Literal["interleaved", "branching"],
        D(
            "Multi-turn rollouts: interleaved (all examples' turns run concurrently; a rollout's turns are "
            "stitched into one sample) or branching (one example's trajectories run to the end before the "
            "next; one training sample per turn)."
        ),
    ] = "interleaved"
    max_concurrent: Annotated[
        int, D("Requests in flight at once (concurrency.mode fixed; adaptive: the default ceiling).", ge=1)
    ] = 256
    concurrency: Annotated[
        ConcurrencyConfig,
        D("Fixed or adaptive in-flight cap ([orchestrator.concurrency], prime-rl's names)."),
    ] = msgspec.field(default_factory=ConcurrencyConfig)
    seed: Annotated[int, D("Seed of task order and environment data.")] = 0
    train: TrainEnvsConfig = msgspec.field(default_factory=TrainEnvsConfig)
    eval: Annotated[EvalConfig | None, D("Online evaluation ([orchestrator.eval]).")] = None
    val: Annotated[ValConfig | None, D("Validation on the env's val split.")] = None
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    algo: Annotated[
        AlgoConfig | None,
        D("The training algorithm (prime-rl's [orchestrator.algo]; unset: training_mode's, else grpo)."),
    ] = None
    advantage: AdvantageConfig = msgspec.field(default_factory=AdvantageConfig)
    teacher: Annotated[TeacherConfig | None, D("Older name: the teacher of training_mode opd / sft.")] = None
    renderer: RendererConfig = msgspec.field(default_factory=RendererConfig)
    request_timeout_s: Annotated[float, D("Timeout of one inference request.", gt=0)] = 600.0
    env_workers: Annotated[
        int,
        D("Worker processes per env server (hosted [infrastructure] compute_size S/M/L = 1/2/4).", ge=0),
    ] = 1
    env_server_max_restarts: Annotated[
        int, D("Restarts of a dead env server in one run before the run ends naming the env.", ge=0)
    ] = 3
    policy_timeout_s: Annotated[float, D("Seconds to wait for a policy before failing.", gt=0)] = 1800.0
    server_down_timeout_s: Annotated[
        float,
        D(
            "Seconds an inference server may stay dead (its supervisor restarts it) before the run ends, "
            "naming it; its requests go to the other servers meanwhile.",
            gt=0,
        ),
    ] = 300.0
    systematic_error_rollouts: Annotated[
        int,
        D(
            "End the run when this many rollouts of one env in a row fail with the same cause (never a "
            "success since the start, or none in that window); the last line names env, cause and fix "
            "(0 = count errors only).",
            ge=0,
        ),
    ] = 64
    log: Annotated[LogConfig | None, D("Orchestrator log overrides.")] = None
    env_vars: Annotated[
        EnvVars,
        D("Environment variables of the orchestrator and its env servers (over the top-level env_vars)."),
    ] = msgspec.field(default_factory=dict)
    wandb: Annotated[
        RoleWandbConfig | None,
        D("Orchestrator W&B overrides (log_extras); needs W&B on ([wandb] or --wandb)."),
    ] = None
    # -- issue 51: saved rollouts --
    save_rollouts: SaveRolloutsConfig = msgspec.field(default_factory=SaveRolloutsConfig)

    def __post_init__(self) -> None:
        fold_older_keys(self)


def fold_older_keys(o: OrchestratorConfig) -> None:
    """hpcrl's older keys set [orchestrator.algo] (then read as unset), so the code reads only `algo`:
    training_mode + [orchestrator.teacher] give its type and model, advantage.length_penalty its
    penalty. Combinations that cannot be folded (both names set, opd without a teacher) are left as
    they are for hpcrl.config.validate to name in one line. Runs on every conversion: idempotent."""
    if o.algo is None:
        mode = o.training_mode or "rl"
        if mode == "rl" and o.teacher is None:
            o.algo, o.training_mode = AlgoConfig(), None
        elif mode != "rl" and o.teacher is not None:
            t = o.teacher
            ref = FrozenModelConfig(base_url=t.base_url, name=t.model, api_key_var=t.api_key_var)
            if mode == "opd":
                o.algo = AlgoConfig(type="opd", teacher=ref)
            else:
                o.algo = AlgoConfig(type="sft", sampling=AlgoSamplingConfig(source=ref))
            o.training_mode, o.teacher = None, None
    c = o.advantage.length_penalty
    if c > 0 and o.algo is not None and o.algo.type in ("grpo", "echo") and o.algo.length_penalty is None:
        o.algo.length_penalty = LengthPenaltyConfig(
            num_output_tokens_weight=c, num_input_tokens_weight=0.0, num_turns_weight=0.0
        )
        o.advantage.length_penalty = 0.0
