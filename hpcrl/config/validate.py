"""Cross-field validation: the checks a single field's type cannot express. Each raises ConfigError."""

from __future__ import annotations

import re

from hpcrl.config.algo_checks import check_algo, check_algo_room
from hpcrl.config.sanity import check_output_dir
from hpcrl.config.schema import CkptConfig, Config, EnvConfig, SFTConfig, TrainerModelConfig
from hpcrl.config.sections import environ, vllm
from hpcrl.config.sections.vlm import SFTModelConfig
from hpcrl.errors import ConfigError

_TIME_RE = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$|^\d+$|^\d+:\d{2}$")
_MEM_RE = re.compile(r"^\d+[KMGT]?$")


def validate(cfg: Config, require_envs: bool = True) -> None:
    check_output_dir(cfg.output_dir)
    _unsupported(cfg)
    own, where = trainer_model(cfg)
    SFTModelConfig.check_vlm(own, where)  # [model.vlm] against impl, ep, cp, LoRA (RL: multimodal rollouts)
    _vlm_reference(cfg, own, where)
    _fake_data(cfg, require_envs)  # before the envs: a fake-data trainer config names none
    _orchestrator(cfg, samples=require_envs)
    _buffer(cfg)
    _envs(cfg, require_envs)
    _deployment(cfg)
    _kv_cache(cfg)
    environ.check_config(cfg)  # env_vars tables
    vllm.check_inference(cfg)  # [inference.vllm] and prime-rl's inference keys
    _broadcast(cfg)
    _ckpt(cfg)
    _slurm(cfg)
    for role in ("trainer", "orchestrator"):
        if getattr(cfg, role).wandb is not None and cfg.wandb is None:
            raise ConfigError(f"{role}.wandb", "needs W&B on ([wandb] or --wandb): it changes what W&B gets")
    if cfg.model.name is None or not cfg.model.name.strip():
        raise ConfigError("model.name", "is required (an HF id, a local dir, or hpcrl/tiny-qwen3)")


def _kv_cache(cfg: Config) -> None:
    """The hf engine's KV capacity must hold one full context (hpcrl.inference.kv_budget, issue 53)."""
    kv, ctx = cfg.inference.kv_cache_tokens, cfg.inference.max_model_len or cfg.seq_len
    if kv is not None and kv < ctx:
        raise ConfigError(
            "inference.kv_cache_tokens", f"{kv} cannot hold one sequence of max_model_len = {ctx}"
        )


def validate_sft(cfg: SFTConfig) -> None:
    """The SFT root's cross-field checks (the data file itself is only opened by the trainer)."""
    check_output_dir(cfg.output_dir)
    if cfg.model.name is None or not cfg.model.name.strip():
        raise ConfigError("model.name", "is required (an HF id, a local dir, or hpcrl/tiny-qwen3)")
    environ.check_config(cfg)  # env_vars
    _unsupported(cfg)
    cfg.model.check_vlm("model")  # [model.vlm] against impl, ep, cp, LoRA
    if cfg.model.vlm is not None and cfg.eval is not None:
        raise ConfigError(
            "eval",
            "online evaluation of a vision-language model ([model.vlm]) is not supported yet; drop [eval]",
        )
    if cfg.ckpt is not None and cfg.ckpt.adapter_interval and cfg.model.lora is None:
        raise ConfigError(
            "ckpt.adapter_interval", f"{cfg.ckpt.adapter_interval} needs LoRA training ([model.lora])"
        )
    _expert_adapters(cfg.ckpt, cfg.model)
    if cfg.data.type == "sft" and not cfg.data.name.strip():
        raise ConfigError(
            "data.name", "is required (a jsonl/parquet file, a directory of them, or a saved dataset)"
        )
    if cfg.data.type == "sft":
        for k, default in (("length", "fixed"), ("input_ids", "increasing")):
            if getattr(cfg.data, k) != default:
                raise ConfigError(f"data.{k}", "applies to data.type = 'fake' only")
    if cfg.val.data is not None and not cfg.val.data.name.strip():
        raise ConfigError(
            "val.data.name", "is empty (give a file, or drop [val.data] to hold out val.fraction)"
        )
    if cfg.val.stop_at_loss > 0 and cfg.val.interval == 0:
        raise ConfigError(
            "val.stop_at_loss",
            f"{cfg.val.stop_at_loss} needs val.interval > 0 (no validation loss to compare)",
        )
    seq_len = cfg.data.seq_len or cfg.seq_len
    if cfg.micro_batch_tokens < seq_len:
        raise ConfigError(
            "micro_batch_tokens",
            f"{cfg.micro_batch_tokens} must be at least the packed row length ({seq_len})",
        )
    cfg.optim.check("optim")
    _ckpt_fields(cfg.ckpt, cfg.max_steps)


def _vlm_reference(cfg: Config | SFTConfig, own: TrainerModelConfig, where: str) -> None:
    """opd / opsd score each sampled sequence by its token ids alone (a teacher's or the policy's
    prompt_logprobs): with images, the reference would score image placeholders without pixels."""
    if isinstance(cfg, SFTConfig) or own.vlm is None or cfg.orchestrator.algo is None:
        return
    algos = [("orchestrator.algo.type", cfg.orchestrator.algo)]
    algos += [
        (f"orchestrator.train.env[{i}].algo.type", e.algo) for i, e in enumerate(cfg.orchestrator.train.env)
    ]
    for field, algo in algos:
        if algo is not None and algo.type in ("opd", "opsd"):
            raise ConfigError(
                field,
                f"'{algo.type}' scores each sequence by its token ids only, so the reference would score "
                f"image placeholders without their pixels: not supported with [{where}.vlm] (use grpo, "
                "max_rl, rae or echo)",
            )


def trainer_model(cfg: Config | SFTConfig) -> tuple[TrainerModelConfig, str]:
    """The trainer's model section and the name of the table the user wrote its fields in: the
    loader flows [model] into [trainer.model] (a Config built in code may lack it)."""
    if isinstance(cfg, SFTConfig):
        return cfg.model, "model"
    own = cfg.trainer.model or cfg.model
    keys = ("dtype", "optimization_dtype", "reduce_dtype", "cp", "ep", "impl")
    flowed = all(getattr(own, k) == getattr(cfg.model, k) for k in keys)
    return own, "model" if flowed else "trainer.model"


# Fields parsed for compatibility with prime-rl / hosted configs that nothing implements yet: a
# non-default value is an error, never silently ignored. (path, allowed values or None for the
# default only, what to do instead). Paths are relative to the root; model sections are expanded.
UNSUPPORTED: tuple[tuple[str, tuple[object, ...], str], ...] = ()
_MODEL_SECTIONS = ("model", "trainer.model", "orchestrator.model", "inference.model")


def _get(root: object, path: str) -> tuple[bool, object]:
    """(present, value) of a dotted path; a missing section (None) or field is absent."""
    obj = root
    for part in path.split("."):
        if obj is None or not hasattr(obj, part):
            return False, None
        obj = getattr(obj, part)
    return True, obj


def _unsupported(cfg: Config | SFTConfig) -> None:
    for path, allowed, instead in UNSUPPORTED:
        paths = [s + path[len("model") :] for s in _MODEL_SECTIONS] if path.startswith("model.") else [path]
        for p in paths:
            present, value = _get(cfg, p)
            if present and value not in allowed:
                ok = ", ".join(repr(a) for a in allowed)
                raise ConfigError(p, f"{value!r} is not supported yet (allowed: {ok}); {instead}")


def _orchestrator(cfg: Config, samples: bool = True) -> None:
    """`samples`: the config runs an orchestrator (a trainer or inference server alone samples
    nothing, so a completion longer than seq_len is not theirs to refuse)."""
    o = cfg.orchestrator
    if o.batch_size % o.rollouts_per_example:
        raise ConfigError(
            "orchestrator.batch_size",
            f"{o.batch_size} is not a multiple of orchestrator.rollouts_per_example ({o.rollouts_per_example})",
        )
    max_tokens = o.train.sampling.max_tokens
    # A completion may fill the whole sequence (the docs' multi-node example sets both to 32768);
    # only a completion that cannot fit at all is an error.
    if samples and max_tokens > cfg.seq_len:
        raise ConfigError(
            "orchestrator.train.sampling.max_tokens",
            f"{max_tokens} is longer than seq_len ({cfg.seq_len}); allowed: at most seq_len (raise seq_len)",
        )
    if (
        samples
        and o.eval is not None
        and o.eval.sampling is not None
        and o.eval.sampling.max_tokens > cfg.seq_len
    ):
        raise ConfigError(
            "orchestrator.eval.sampling.max_tokens",
            f"{o.eval.sampling.max_tokens} is longer than seq_len ({cfg.seq_len}); allowed: at most seq_len",
        )
    check_algo(o)
    check_algo_room(cfg)
    if o.max_off_policy_steps < o.max_async_level:
        raise ConfigError(
            "orchestrator.max_off_policy_steps",
            f"{o.max_off_policy_steps} < max_async_level ({o.max_async_level}): every async sample would be dropped",
        )
    if cfg.trainer.micro_batch_tokens < cfg.seq_len:
        raise ConfigError(
            "trainer.micro_batch_tokens",
            f"{cfg.trainer.micro_batch_tokens} must be at least seq_len ({cfg.seq_len}) so one sample fits",
        )
    cfg.trainer.optim.check("trainer.optim")
    cfg.trainer.loss.check("trainer.loss")


def _buffer(cfg: Config) -> None:
    b = cfg.orchestrator.buffer
    if b.hard_threshold > b.easy_threshold:
        raise ConfigError(
            "orchestrator.buffer.hard_threshold",
            f"{b.hard_threshold} is above easy_threshold ({b.easy_threshold}); need hard <= easy",
        )
    envs = cfg.orchestrator.train.env
    if b.env_ratios is not None:
        if len(b.env_ratios) != len(envs):
            raise ConfigError(
                "orchestrator.buffer.env_ratios",
                f"has {len(b.env_ratios)} entries but there are {len(envs)} training envs",
            )
        if any(r < 0 for r in b.env_ratios) or sum(b.env_ratios) <= 0:
            raise ConfigError("orchestrator.buffer.env_ratios", "must be non-negative with a positive sum")
        if any(e.ratio is not None for e in envs):
            raise ConfigError(
                "orchestrator.buffer.env_ratios", "set either buffer.env_ratios or env ratio, not both"
            )


def _envs(cfg: Config, require_envs: bool) -> None:
    o = cfg.orchestrator
    if require_envs and not o.train.env:
        raise ConfigError(
            "orchestrator.train.env",
            "at least one training environment is required ([[orchestrator.train.env]] id = ...)",
        )
    _unique_names(o.train.env, "orchestrator.train.env")
    if o.eval is not None:
        _unique_names(o.eval.env, "orchestrator.eval.env")


def _unique_names(envs: list[EnvConfig], path: str) -> None:
    seen: set[str] = set()
    for i, e in enumerate(envs):
        name = e.name or e.id.rsplit("/", 1)[-1]
        if name in seen:
            raise ConfigError(
                f"{path}[{i}].name", f"duplicate env name '{name}'; give each env a distinct name"
            )
        seen.add(name)


def _broadcast(cfg: Config) -> None:
    b = cfg.trainer.broadcast
    if b.delta and b.transport == "collective":
        # Delta saves the bytes of a shared filesystem that every server node reads. Over the
        # collective each byte crosses a receiver's link once (~0.2 s for 61 GB at 8 NICs a node), the
        # encode and apply cost more than that (docs/weights.md), and a vLLM worker would keep its
        # delta base, a whole policy, in GPU memory.
        raise ConfigError(
            "trainer.broadcast.delta",
            "true needs policies as files: allowed with trainer.broadcast.transport = 'filesystem' or "
            "'auto' (which then picks files); with 'collective' set delta = false",
        )
    if b.delta and cfg.inference.backend == "vllm":
        # The base of a delta is the parameters a server already serves, updated in place: the hf
        # engine's are the policy's own tensors; vLLM's are fused and sharded (qkv, gate_up, tp).
        raise ConfigError(
            "trainer.broadcast.delta",
            "true needs servers that apply a delta in place to the weights they serve: the hf engine, not "
            "vLLM (its parameters are fused and sharded); set delta = false or inference.backend = 'hf'",
        )
    if b.delta and cfg.inference.quantization is not None:
        # A delta applies to the weights a server holds; quantized ones are not the policy's own.
        raise ConfigError(
            "trainer.broadcast.delta",
            f"true cannot apply to quantized weights (inference.quantization = {cfg.inference.quantization!r}); "
            "set delta = false",
        )


def _deployment(cfg: Config) -> None:
    d = cfg.deployment
    single = d.num_train_gpus is not None or d.num_infer_gpus is not None
    multi = d.num_train_nodes is not None or d.num_infer_nodes is not None
    if single and multi:
        raise ConfigError(
            "deployment",
            "set num_train_gpus/num_infer_gpus (one node) or num_train_nodes/num_infer_nodes, not both",
        )
    if single:
        total = (d.num_train_gpus or 0) + (d.num_infer_gpus or 0)
        if total > d.gpus_per_node:
            raise ConfigError(
                "deployment.num_train_gpus",
                f"num_train_gpus + num_infer_gpus = {total} exceeds gpus_per_node ({d.gpus_per_node})",
            )
        if d.num_train_gpus == 0:
            raise ConfigError("deployment.num_train_gpus", "must be at least 1")
        if d.num_infer_gpus == 0:
            raise ConfigError("deployment.num_infer_gpus", "must be at least 1")
        tp = cfg.inference.parallel.tp
        if d.num_infer_gpus is not None and d.num_infer_gpus % tp:
            raise ConfigError(
                "inference.parallel.tp", f"{tp} does not divide num_infer_gpus ({d.num_infer_gpus})"
            )
    if multi:
        if (d.num_train_nodes is None) != (d.num_infer_nodes is None):
            raise ConfigError("deployment.num_infer_nodes", "set both num_train_nodes and num_infer_nodes")
        tp = cfg.inference.parallel.tp
        if d.gpus_per_node and d.gpus_per_node % tp and tp <= d.gpus_per_node:
            raise ConfigError(
                "inference.parallel.tp", f"{tp} does not divide gpus_per_node ({d.gpus_per_node})"
            )
        if cfg.slurm is not None and cfg.slurm.nodes is not None:
            total = (d.num_train_nodes or 0) + (d.num_infer_nodes or 0)
            if total != cfg.slurm.nodes:
                raise ConfigError(
                    "slurm.nodes", f"{cfg.slurm.nodes} != num_train_nodes + num_infer_nodes ({total})"
                )


def _fake_data(cfg: Config, require_envs: bool) -> None:
    """[trainer.data.fake] is the trainer alone (hpcrl.trainer.rl_fake): no orchestrator, no checkpoint."""
    if cfg.trainer.data.fake is None:
        return
    if require_envs:
        raise ConfigError(
            "trainer.data.fake",
            "trains the trainer alone on made-up batches: run `hpcrl trainer`, not a whole run",
        )
    if cfg.ckpt is not None:
        raise ConfigError(
            "trainer.data.fake", "writes no checkpoints (a benchmark of made-up batches): drop [ckpt]"
        )


def _ckpt(cfg: Config) -> None:
    c = cfg.ckpt
    if c is None:
        return
    _ckpt_fields(c, cfg.max_steps)
    lora = (cfg.trainer.model or cfg.model).lora
    if c.save_adapter_separately and lora is None:
        raise ConfigError("ckpt.save_adapter_separately", "needs LoRA training ([model.lora])")
    if c.adapter_interval and lora is None:
        raise ConfigError("ckpt.adapter_interval", f"{c.adapter_interval} needs LoRA training ([model.lora])")
    _expert_adapters(c, cfg.trainer.model or cfg.model)


def _expert_adapters(c: CkptConfig | None, model: TrainerModelConfig | SFTModelConfig) -> None:
    """A VL MoE's expert LoRA (target "experts", hpcrl.models.vlm_moe) is no part of peft's adapter
    files: the run's exported weights (merged) carry it, an adapter alone would lose it."""
    lora = model.lora
    if (
        c is None
        or lora is None
        or "experts" not in lora.target_modules
        or getattr(model, "vlm", None) is None
    ):
        return
    why = (
        "the stacked experts' LoRA (target 'experts') is not in peft's adapter files; use the merged weights"
    )
    if c.save_adapter_separately:
        raise ConfigError("ckpt.save_adapter_separately", f"true with [vlm]: {why}")
    if c.adapter_interval:
        raise ConfigError("ckpt.adapter_interval", f"{c.adapter_interval} with [vlm]: {why}")


def _ckpt_fields(c: CkptConfig | None, max_steps: int) -> None:
    if c is None:
        return
    if c.keep_interval is not None and c.interval is not None and c.keep_interval % c.interval:
        raise ConfigError(
            "ckpt.keep_interval", f"{c.keep_interval} is not a multiple of ckpt.interval ({c.interval})"
        )
    if c.resume_step is not None and c.resume_step > max_steps:
        raise ConfigError("ckpt.resume_step", f"{c.resume_step} is beyond max_steps ({max_steps})")
    if c.weights_only and c.hf_weights == "never":
        raise ConfigError(
            "ckpt.hf_weights",
            "'never' with ckpt.weights_only would save nothing (weights_only writes only the HF weights)",
        )


def _slurm(cfg: Config) -> None:
    s = cfg.slurm
    if s is None:
        return
    if not _TIME_RE.match(s.time):
        raise ConfigError("slurm.time", f"'{s.time}' is not a SLURM time (HH:MM:SS, D-HH:MM:SS or minutes)")
    if s.mem is not None and not _MEM_RE.match(s.mem):
        raise ConfigError("slurm.mem", f"'{s.mem}' is not a SLURM memory size (e.g. 0, 64G, 512000M)")
    limit = time_seconds(s.time)
    if limit is not None and s.signal_before_s >= limit:  # SLURM would signal at once: requeue forever
        raise ConfigError(
            "slurm.signal_before_s",
            f"{s.signal_before_s} must be below the time limit ({s.time!r} = {limit} s)",
        )
    for i, opt in enumerate(s.extra_sbatch):
        if not opt.startswith("--"):
            raise ConfigError(
                f"slurm.extra_sbatch[{i}]", f"'{opt}' must be a long sbatch option like --exclusive"
            )


def time_seconds(t: str | int) -> int | None:
    """A SLURM time limit in seconds (minutes, M:S, H:M:S, D-H, D-H:M, D-H:M:S); None = unlimited."""
    if isinstance(t, int):
        return t * 60
    if t.upper() in ("INFINITE", "UNLIMITED", "-1"):
        return None
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", t.strip())
    if m is None:
        raise ValueError(f"time {t!r} is not a SLURM time limit (e.g. 90, 01:30:00, 1-00:00:00)")
    days, a, b, c = m.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-H, D-H:M, D-H:M:S
        h, mi, sec = (parts + [0, 0])[:3]
        return ((int(days) * 24 + h) * 60 + mi) * 60 + sec
    if len(parts) == 1:
        return parts[0] * 60  # minutes
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]  # M:S
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]
