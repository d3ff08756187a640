"""Typed config: one msgspec Struct per section; every field has a one-line description (its --help text).

Sections mirror prime-rl: model, trainer, orchestrator (train / eval / val / buffer / advantage / teacher),
inference, server, deployment, slurm, ckpt, wandb, log. Shared top-level fields (model.name, max_steps,
seq_len, output_dir) flow into the sections that restate them; conflicting explicit values are errors
(see hpcrl.config.loader). Unknown keys are rejected everywhere.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta


def D(desc: str, **constraints: Any) -> Meta:
    """Shorthand for a field's description (+ optional range constraints)."""
    return Meta(description=desc, **constraints)


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=False):
    """Base of every config section: unknown keys are errors."""


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# trainer
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# orchestrator
# ---------------------------------------------------------------------------------------------
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
    std_normalize: Annotated[bool, D("Divide group-relative advantages by the group std.")] = False
    length_penalty: Annotated[
        float, D("Subtract coef * (len/mean_len - 1) from the advantage (0 = off).", ge=0)
    ] = 0.0
    zero_advantage: Annotated[
        Literal["keep", "drop"],
        D(
            "Groups whose rewards are all equal: keep, or drop and generate replacements (after 16 rounds "
            "that leave the batch short, it is filled with dropped groups, advantage 0, and a warning)."
        ),
    ] = "drop"


class TeacherConfig(Section):
    base_url: Annotated[str, D("OpenAI-compatible endpoint of the teacher (opd / sft modes).")]
    model: Annotated[str | None, D("Teacher model name at that endpoint.")] = None
    api_key_var: Annotated[str, D("Environment variable holding the teacher's API key.")] = "OPENAI_API_KEY"


class RendererConfig(Section):
    name: Annotated[str, D("Chat renderer: default (the tokenizer's chat template).")] = "default"


class OrchestratorConfig(Section):
    model: Annotated[ModelConfig | None, D("Orchestrator-side model overrides (name must agree).")] = None
    max_steps: Annotated[Annotated[int, Meta(ge=0)] | None, D("Shared: final training step.")] = None
    seq_len: Annotated[Annotated[int, Meta(ge=8)] | None, D("Shared: max tokens per sample.")] = None
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
        Literal["rl", "opd", "sft"], D("rl; opd (KL to a teacher); sft (teacher generates).")
    ] = "rl"
    trajectory_strategy: Annotated[
        Literal["interleaved", "branching"],
        D(
            "Multi-turn rollouts: interleaved (all examples' turns run concurrently; a rollout's turns are "
            "stitched into one sample) or branching (one example's trajectories run to the end before the "
            "next; one training sample per turn)."
        ),
    ] = "interleaved"
    max_concurrent: Annotated[int, D("Rollouts in flight at once.", ge=1)] = 256
    seed: Annotated[int, D("Seed of task order and environment data.")] = 0
    train: TrainEnvsConfig = msgspec.field(default_factory=TrainEnvsConfig)
    eval: Annotated[EvalConfig | None, D("Online evaluation ([orchestrator.eval]).")] = None
    val: Annotated[ValConfig | None, D("Validation on the env's val split.")] = None
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    advantage: AdvantageConfig = msgspec.field(default_factory=AdvantageConfig)
    teacher: Annotated[TeacherConfig | None, D("Teacher endpoint for opd / sft modes.")] = None
    renderer: RendererConfig = msgspec.field(default_factory=RendererConfig)
    request_timeout_s: Annotated[float, D("Timeout of one inference request.", gt=0)] = 600.0
    policy_timeout_s: Annotated[float, D("Seconds to wait for a policy before failing.", gt=0)] = 1800.0
    server_down_timeout_s: Annotated[
        float,
        D(
            "Seconds an inference server may stay dead (its supervisor restarts it) before the run ends, "
            "naming it; its requests go to the other servers meanwhile.",
            gt=0,
        ),
    ] = 300.0
    log: Annotated[LogConfig | None, D("Orchestrator log overrides.")] = None


# ---------------------------------------------------------------------------------------------
# inference / server / deployment / slurm
# ---------------------------------------------------------------------------------------------
class InferenceParallelConfig(Section):
    tp: Annotated[int, D("Tensor parallel size inside each inference replica.", ge=1)] = 1
    dp: Annotated[int, D("Data parallel replicas per node.", ge=1)] = 1


class InferenceConfig(Section):
    model: Annotated[ModelConfig | None, D("Inference-side model overrides (name must agree).")] = None
    seq_len: Annotated[
        Annotated[int, Meta(ge=8)] | None, D("Shared: max context (flows into max_model_len when unset).")
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


class DeploymentConfig(Section):
    num_train_gpus: Annotated[Annotated[int, Meta(ge=0)] | None, D("Single node: GPUs for the trainer.")] = (
        None
    )
    num_infer_gpus: Annotated[Annotated[int, Meta(ge=0)] | None, D("Single node: GPUs for inference.")] = None
    num_train_nodes: Annotated[Annotated[int, Meta(ge=1)] | None, D("Multi-node: trainer nodes.")] = None
    num_infer_nodes: Annotated[Annotated[int, Meta(ge=1)] | None, D("Multi-node: inference nodes.")] = None
    gpus_per_node: Annotated[int, D("GPUs on each node (multi-node layout).", ge=0)] = 8
    num_trainer_ranks: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        D("CPU: trainer processes (default 1; on GPU one per trainer GPU)."),
    ] = None
    num_inference_servers: Annotated[
        Annotated[int, Meta(ge=1)] | None, D("CPU: inference servers (default 1).")
    ] = None
    orchestrator_node: Annotated[
        Literal["trainer", "inference"], D("Where the orchestrator runs on SLURM.")
    ] = "trainer"
    compute: Annotated[
        Literal["auto", "cpu"],
        D(
            "auto: CUDA where present. cpu: every role computes on CPU even where GPUs are allocated "
            "(rehearse a GPU job on a fake-GPU SLURM); placement and GPU requests are unchanged."
        ),
    ] = "auto"
    max_server_restarts: Annotated[
        int,
        D(
            "Times the supervisor (hpcrl run, or the SLURM server step) restarts one dead inference server "
            "before giving up (0 = a dead server ends the job).",
            ge=0,
        ),
    ] = 5


class SlurmConfig(Section):
    partition: Annotated[str | None, D("SLURM partition.")] = None
    account: Annotated[str | None, D("SLURM account.")] = None
    qos: Annotated[str | None, D("SLURM QOS.")] = None
    time: Annotated[str, D("Walltime (HH:MM:SS or D-HH:MM:SS).")] = "24:00:00"
    job_name: Annotated[str | None, D("Job name (default: the run name).")] = None
    gpus_per_node: Annotated[int, D("GPUs requested per node.", ge=0)] = 8
    cpus_per_task: Annotated[int, D("CPUs per task.", ge=1)] = 1
    mem: Annotated[str | None, D("Memory per node (e.g. 0, 400G).")] = None
    constraint: Annotated[str | None, D("Node feature constraint.")] = None
    nodes: Annotated[
        Annotated[int, Meta(ge=2)] | None, D("Total nodes (split by deployment or 1 : rest).")
    ] = None
    signal_before_s: Annotated[int, D("Seconds before the time limit to checkpoint and requeue.", ge=10)] = (
        300
    )
    requeue: Annotated[bool, D("Requeue on preemption / time limit and resume automatically.")] = True
    extra_sbatch: Annotated[list[str], D("Extra #SBATCH options, e.g. ['--exclusive'].")] = msgspec.field(
        default_factory=list
    )
    setup: Annotated[list[str], D("Shell lines run on every node before the job (module load, venv).")] = (
        msgspec.field(default_factory=list)
    )


# ---------------------------------------------------------------------------------------------
# ckpt / wandb / log
# ---------------------------------------------------------------------------------------------
class CkptConfig(Section):
    interval: Annotated[
        Annotated[int, Meta(ge=1)] | None, D("Checkpoint every N steps (unset: at the end only).")
    ] = None
    keep_last: Annotated[Annotated[int, Meta(ge=1)] | None, D("Keep only the newest K checkpoints.")] = None
    keep_interval: Annotated[
        Annotated[int, Meta(ge=1)] | None, D("Also keep every M-th step permanently.")
    ] = None
    resume_step: Annotated[
        Annotated[int, Meta(ge=-1)] | None, D("Resume from this checkpoint step (-1 = newest complete).")
    ] = None
    weights_only: Annotated[
        bool, D("Write only weights/step_N (HF dir), no optimizer/orchestrator state.")
    ] = False
    save_adapter_separately: Annotated[bool, D("LoRA: also write the raw adapter beside merged weights.")] = (
        False
    )
    adapter_interval: Annotated[
        int, D("LoRA: write adapters/step_N every N steps and at the final step (0 = off).", ge=0)
    ] = 0
    warm_start: Annotated[str | None, D("Initialise weights from this checkpoint or weights dir.")] = None
    warm_start_optimizer: Annotated[
        bool,
        D(
            "Also carry the warm-start checkpoint's optimizer state (AdamW moments) over; needs a "
            "complete checkpoint with a trainer part (not a bare weights dir) and the same LoRA shape."
        ),
    ] = False


class LogExtrasConfig(Section):
    interval: Annotated[int, D("Log sample tables and distributions every N steps.", ge=1)] = 10
    sample_ratio: Annotated[float, D("Fraction of samples in the tables.", gt=0, le=1)] = 0.1
    samples: Annotated[bool, D("Log prompt/completion tables.")] = True
    distributions: Annotated[bool, D("Log reward/advantage/entropy distributions.")] = True


class WandbConfig(Section):
    project: Annotated[str, D("W&B project.")] = "hpcrl"
    name: Annotated[str | None, D("W&B run name (default: the run name).")] = None
    entity: Annotated[str | None, D("W&B team/entity.")] = None
    offline: Annotated[bool, D("Log offline (no network); sync later with `wandb sync`.")] = False
    log_extras: LogExtrasConfig = msgspec.field(default_factory=LogExtrasConfig)


class LogConfig(Section):
    level: Annotated[
        Literal["debug", "info", "warning", "error"] | None,
        D("Log level (default info or $HPCRL_LOG_LEVEL)."),
    ] = None
    vf_level: Annotated[
        Literal["debug", "info", "warning", "error"], D("Environment / verifiers log level.")
    ] = "warning"
    console_interval: Annotated[int, D("Print one console line every N steps.", ge=1)] = 1


# ---------------------------------------------------------------------------------------------
# root
# ---------------------------------------------------------------------------------------------
class Config(Section):
    name: Annotated[str | None, D("Run name (default: the output dir's name).")] = None
    type: Annotated[
        Literal["rl", "full_finetune"], D("Run type; full_finetune is the hosted native shape.")
    ] = "rl"
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    max_steps: Annotated[
        int, D("Final training step (a resume runs up to it, not for that many more).", ge=0)
    ] = 20
    seq_len: Annotated[int, D("Max tokens per sample (prompt + completion).", ge=8)] = 512
    output_dir: Annotated[str, D("Run directory (checkpoints, logs, bus files).")] = "outputs/run"
    clean_output_dir: Annotated[bool, D("Delete output_dir before starting.")] = False
    seed: Annotated[int, D("Global seed (trainer, orchestrator and sampling derive from it).")] = 0
    deterministic: Annotated[
        bool,
        D("Deterministic mode: seeded sampling, fixed policy lag; resumes are bitwise identical on CPU."),
    ] = False
    watchdog_s: Annotated[
        float,
        D(
            "A role (trainer, orchestrator, inference server) that makes no progress for this many seconds is "
            "named in its log and exits 3, ending the job (0 = off).",
            ge=0,
        ),
    ] = 1800.0
    env_files: Annotated[
        list[str], D("Files of KEY=VALUE secrets loaded into the environment (never logged).")
    ] = msgspec.field(default_factory=list)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    orchestrator: OrchestratorConfig = msgspec.field(default_factory=OrchestratorConfig)
    inference: InferenceConfig = msgspec.field(default_factory=InferenceConfig)
    server: ServerConfig = msgspec.field(default_factory=ServerConfig)
    deployment: DeploymentConfig = msgspec.field(default_factory=DeploymentConfig)
    slurm: Annotated[SlurmConfig | None, D("SLURM settings for `hpcrl submit`.")] = None
    ckpt: Annotated[CkptConfig | None, D("Checkpointing (off unless --ckpt or a [ckpt] table).")] = None
    wandb: Annotated[WandbConfig | None, D("Weights & Biases (off unless --wandb or a [wandb] table).")] = (
        None
    )
    log: LogConfig = msgspec.field(default_factory=LogConfig)


# ---------------------------------------------------------------------------------------------
# SFT root (hpcrl sft)
# ---------------------------------------------------------------------------------------------
class SFTDataConfig(Section):
    name: Annotated[str, D("Local jsonl/parquet file, a directory of them, or a saved HF datasets dir.")] = ""
    split: Annotated[str, D("Split for saved dataset dicts.")] = "train"
    batch_size: Annotated[int, D("Samples per optimizer step.", ge=1)] = 32
    seq_len: Annotated[
        Annotated[int, Meta(ge=8)] | None, D("Packed row length (default: top-level seq_len).")
    ] = None
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
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    max_steps: Annotated[int, D("Final optimizer step.", ge=0)] = 100
    seq_len: Annotated[int, D("Max tokens per packed row.", ge=8)] = 512
    output_dir: Annotated[str, D("Run directory.")] = "outputs/sft"
    clean_output_dir: Annotated[bool, D("Delete output_dir before starting.")] = False
    seed: Annotated[int, D("Global seed.")] = 0
    data: SFTDataConfig = msgspec.field(default_factory=SFTDataConfig)
    loss_mask: LossMaskConfig = msgspec.field(default_factory=LossMaskConfig)
    val: SFTValConfig = msgspec.field(default_factory=SFTValConfig)
    optim: OptimConfig = msgspec.field(default_factory=lambda: OptimConfig(lr=1e-3))
    micro_batch_tokens: Annotated[int, D("Tokens per micro-batch.", ge=8)] = 4096
    deployment: DeploymentConfig = msgspec.field(default_factory=DeploymentConfig)
    ckpt: Annotated[CkptConfig | None, D("Checkpointing.")] = None
    wandb: Annotated[WandbConfig | None, D("Weights & Biases.")] = None
    log: LogConfig = msgspec.field(default_factory=LogConfig)


SHARED_FIELDS = ("max_steps", "seq_len")
"""Top-level scalars that flow into sections that restate them (model.name handled separately)."""


# ---------------------------------------------------------------------------------------------
# hpcrl eval / hpcrl gepa roots (hpcrl.evaluation)
# ---------------------------------------------------------------------------------------------
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


class EvalLogConfig(Section):
    level: Annotated[
        Literal["debug", "info", "warning", "error"] | None,
        D("Log level (default info or $HPCRL_LOG_LEVEL)."),
    ] = None
    vf_level: Annotated[
        Literal["debug", "info", "warning", "error"], D("Environment / verifiers log level.")
    ] = "warning"


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
