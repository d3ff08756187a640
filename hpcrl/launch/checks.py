"""The checks of a config that need role knowledge: the model's architecture (ep, cp, impl), the
trainer's precision, renderer names, environment ids and their arguments, warm-start checkpoints.

hpcrl/config/ parses and checks shapes only (hpcrl/config/validate.py); a run is planned here, so
every command that starts one loads its config through `load` below, which hands these checks to
the config loader (`checks=`): they run inside its error boundary, where a hosted field is named as
the user wrote it. Each check raises a ConfigError naming its field.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import msgspec

from hpcrl.config import sanity
from hpcrl.config.loader import Loaded
from hpcrl.config.loader import load as load_config
from hpcrl.config.schema import Config, RendererConfig, SFTConfig, TrainerModelConfig
from hpcrl.config.validate import trainer_model
from hpcrl.errors import ConfigError
from hpcrl.models.rules import check_ep
from hpcrl.trainer import precision
from hpcrl.trainer.precision import Precision

__all__ = [
    "activation_offload_note",
    "context_parallel",
    "custom_impl",
    "expert_parallel",
    "load",
    "role_checks",
    "trainer_precision",
]


def load(
    argv: list[str],
    root: type = Config,
    require_envs: bool = True,
    extra: dict[str, Any] | None = None,
    role: str | None = None,
) -> Loaded:
    """`hpcrl.config.load` with the role checks: what every command that starts or plans a run reads."""
    return load_config(argv, root, require_envs=require_envs, extra=extra, role=role, checks=role_checks)


def role_checks(cfg: Config | SFTConfig) -> list[str]:
    """Every role check of a loaded config; returns the notes to print at start."""
    trainer_precision(cfg, on_gpu=True)
    custom_impl(cfg)
    ac_targets(*trainer_model(cfg))
    notes: list[str] = []
    if isinstance(cfg, Config):
        _renderer(cfg.orchestrator.renderer, cfg.model.name, "orchestrator.renderer")
        notes.extend(_envs(cfg))
        notes.extend(_alias_notes(cfg))
        from hpcrl.inference.vllm_args import notes as inference_notes

        notes.extend(inference_notes(cfg))  # prime-rl's GPU-only inference keys: what happens here
    else:
        _renderer(cfg.renderer, cfg.model.name, "renderer")
        if cfg.eval is not None:  # online evals (hpcrl.trainer.sft_eval): the same env checks
            from hpcrl.trainer.sft_eval import check_eval_config

            notes.extend(check_envs([("eval.env", cfg.eval.env)]))
            check_eval_config(cfg)
    _resolve_warm_start(cfg)
    return notes


# -- the model: ep, cp, impl ------------------------------------------------------------------------
def context_parallel(cfg: Config | SFTConfig, trainer_ranks: int, on_gpu: bool) -> None:
    """``trainer.model.cp`` against the placement (run, submit, resume and their --dry-run): it must
    divide the trainer ranks (ranks = dp x cp); ring attention on GPU needs a flash-attention kernel;
    ulysses needs cp to divide the attention heads (where the model's architecture is known locally);
    cp must divide seq_len (a sequence of seq_len tokens splits evenly; a micro-batch of shorter
    samples that cp does not divide is still padded with a padding sample of its own)."""
    model, field = trainer_model(cfg)
    cp = model.cp
    if cp == 1:
        return
    if trainer_ranks % cp:
        raise ConfigError(f"{field}.cp", f"{cp} must divide the number of trainer ranks ({trainer_ranks})")
    if cfg.seq_len % cp:
        raise ConfigError(
            f"{field}.cp", f"{cp} must divide seq_len ({cfg.seq_len}); use a seq_len that it does"
        )
    if model.cp_mode == "ulysses":
        from hpcrl.models.arch import find_arch

        arch = find_arch(model.name)
        if arch is not None and arch.heads % cp:
            raise ConfigError(
                f"{field}.cp",
                f"{cp} with cp_mode 'ulysses' must divide the model's {arch.heads} attention heads "
                "(use a cp that does, or cp_mode = 'ring')",
            )
        return
    if on_gpu and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError(
            f"{field}.cp",
            f"{cp} on GPU needs a flash-attention kernel (pip install flash-attn), which is not installed",
        )


def expert_parallel(cfg: Config | SFTConfig, trainer_ranks: int) -> None:
    """``trainer.model.ep`` against the placement (run, submit, resume and their --dry-run): the
    one rule (hpcrl.models.rules.check_ep) with the model's architecture where it is known locally,
    and hpcrl's own MoE implementation where the run would load it."""
    from hpcrl.models.arch import find_arch

    model, field = trainer_model(cfg)
    if model.ep == 1:
        return
    arch = find_arch(model.name) if trainer_ranks % model.ep == 0 else None
    check_ep(
        model.ep,
        trainer_ranks,
        num_experts=arch.num_experts if arch is not None and arch.moe else None,
        moe=arch.moe if arch is not None else None,
        model_name=model.name or "",
        field=f"{field}.ep",
    )
    _ep_needs_custom(model, field)


def _ep_needs_custom(model: TrainerModelConfig, field: str) -> None:
    """Expert parallelism is the custom implementation's: refused where the run would load
    transformers' (impl = 'hf', LoRA, or a config.json the custom model does not run)."""
    from hpcrl.models import registry
    from hpcrl.models.arch import local_config

    if getattr(model, "vlm", None) is not None:
        _vl_ep(model, field, local_config(model.name))
        return
    why = "impl = 'hf'" if model.impl == "hf" else "LoRA" if model.lora is not None else None
    if why is None and model.attn == "flash_attention_2":  # only transformers runs it (pick_impl)
        why = "attn = 'flash_attention_2'"
    config = local_config(model.name) if why is None else None
    if config is not None:
        model_type = str(config.get("model_type", ""))
        reason = registry.unsupported(config)
        why = reason if reason else None if model_type in registry.FAMILIES else f"model_type {model_type!r}"
    if why is not None:
        raise ConfigError(
            f"{field}.ep",
            f"{model.ep} needs hpcrl's own MoE implementation (impl = 'custom' or 'auto'), "
            f"which does not run {why}; use ep = 1",
        )


def _vl_ep(model: TrainerModelConfig, field: str, config: dict | None) -> None:
    """[vlm] with ep > 1: transformers' VL class with hpcrl's expert-parallel MoE blocks
    (hpcrl.models.vlm_moe), any impl or LoRA; the model type checked where config.json is local."""
    from hpcrl.models.registry import VL_MOE_TYPES as MODEL_TYPES

    model_type = None if config is None else str(config.get("model_type", ""))
    if model_type is not None and model_type not in MODEL_TYPES:
        raise ConfigError(
            f"{field}.ep",
            f"{model.ep} with [vlm] runs hpcrl's MoE in {', '.join(MODEL_TYPES)} only, not {model_type!r}; "
            "use ep = 1",
        )


def custom_impl(cfg: Config | SFTConfig) -> None:
    """``impl = "custom"`` against the model's config.json where it is known locally (a directory, a
    built tiny model, the HF cache): a model type without hpcrl's own implementation, or a config it
    does not compute as transformers does (scaled RoPE of a dynamic kind, attention bias, sliding
    windows), is refused at the dry run rather than when the trainer loads it."""
    from hpcrl.models import registry
    from hpcrl.models.arch import local_config

    model, field = trainer_model(cfg)
    if model.impl != "custom":
        return
    config = local_config(model.name)
    if config is None:
        return
    try:
        registry.pick_impl(
            "custom", str(config.get("model_type", "")), lora=model.lora is not None, config=config
        )
    except ConfigError as e:
        raise ConfigError(f"{field}.impl", e.message) from None


def ac_targets(model: Any, field: str) -> None:
    """Selective AC's targets and, with [vlm] on a VL MoE's swapped blocks, their layout
    (hpcrl.models.vlm_moe) against transformers' model built on the meta device from a local
    config.json, as the trainer's build checks them: refused here, not at the build. Only
    transformers' builds ([vlm], impl 'hf', LoRA); a config it cannot build is left to the trainer."""
    from hpcrl.models.arch import local_config

    ac, vlm, lora = getattr(model, "ac", None), getattr(model, "vlm", None), model.lora
    swap = vlm is not None and (model.ep > 1 or (lora is not None and "experts" in lora.target_modules))
    selective = ac is not None and ac.mode == "selective"
    if not swap and not (selective and (vlm is not None or model.impl == "hf" or lora is not None)):
        return
    config = local_config(model.name)
    if config is None:
        return
    import torch
    import transformers

    from hpcrl.models.parallelize import decoder_layers
    from hpcrl.trainer.memory_savers import selective_modules

    try:
        raw = {k: v for k, v in config.items() if k != "model_type"}
        hf = transformers.AutoConfig.for_model(str(config.get("model_type", "")), **raw)
        auto = (
            transformers.AutoModelForImageTextToText if vlm is not None else transformers.AutoModelForCausalLM
        )
        with torch.device("meta"):
            built = auto.from_config(hf)
    except Exception:  # noqa: BLE001 - not buildable here (remote code, an unknown type): the trainer checks
        return
    if swap:  # the blocks' layout as the trainer's swap reads it (transformers >= 5)
        from hpcrl.models.vlm_moe import swap_moe_blocks

        swap_moe_blocks(built, f"{field}.ep" if model.ep > 1 else f"{field}.lora.target_modules")
    if not selective:
        return
    layers = decoder_layers(built)
    have = {t for layer in layers[:: ac.freq] for t, mods in selective_modules(layer).items() if mods}
    missing = [t for t in ac.targets if t not in have]
    if layers and missing:
        raise ConfigError(
            f"{field}.ac.targets",
            f"{missing} name nothing in {type(layers[0]).__name__} (this model's layers have: "
            f"{', '.join(sorted(have))})",
        )


# -- the trainer's precision ------------------------------------------------------------------------
def activation_offload_note(cfg: Config | SFTConfig, on_gpu: bool) -> list[str]:
    """The dry run's lines for trainer model keys (offloading, FP8, full offload) whose effect where
    the trainer computes differs from what they promise on a GPU (hpcrl.config.prime_model)."""
    from hpcrl.config.prime_model import device_notes

    model, field = trainer_model(cfg)
    return [f"note:         {n}" for n in device_notes(model, field, on_gpu)]


def trainer_precision(cfg: Config | SFTConfig, on_gpu: bool) -> Precision:
    """The trainer's precision (hpcrl/trainer/precision.py). Loading checks it as if on GPU (the
    permissive case: ``auto`` is bf16 there); the --dry-run summary and the trainer check it again for
    the devices the trainer really gets."""
    model, field = trainer_model(cfg)
    return precision.of_model(model, on_gpu, field)


# -- renderers, environments, warm start ----------------------------------------------------------
def _renderer(section: RendererConfig, model_name: str | None, field: str) -> None:
    """Name, import_path and thinking_retention resolve (the package is imported only for a renderer
    other than auto/default; the tokenizer check is --dry-run's, hpcrl.render.select.dry_run_check)."""
    if (
        section.name in ("auto", "default")
        and section.import_path is None
        and section.thinking_retention is None
    ):
        return
    from hpcrl.render.select import renderer_config

    renderer_config(section, model_name or "", field)


def _envs(cfg: Config) -> list[str]:
    """Every env id resolves and its arguments are accepted; a runtime is only for 0.4 envs. A prime-rl
    source whose taskset is not installed here falls back to hpcrl's env of that name (hpcrl.envs.sources).
    Returns the notes to print."""
    o = cfg.orchestrator
    lists = [("orchestrator.train.env", o.train.env)]
    if o.eval is not None:
        lists.append(("orchestrator.eval.env", o.eval.env))
    return check_envs(lists)


def check_envs(lists: list[tuple[str, list[Any]]]) -> list[str]:
    """_envs's checks of (path, env entries) lists; a fallen-back entry is replaced in its list."""
    from hpcrl.config.secrets import resolve_refs
    from hpcrl.envs.registry import v1_module, validate_env_spec
    from hpcrl.envs.sources import source_fallback
    from hpcrl.envs.verifiers.v1_runtime import check_name

    notes: list[str] = []
    for path, envs in lists:
        for i, e in enumerate(envs):
            if e.env and v1_module(e.id) is None:
                envs[i] = e = source_fallback(e, f"{path}[{i}]", notes)
            if e.runtime is not None and (bad := check_name(e.runtime)):
                raise ConfigError(f"{path}[{i}].runtime", bad)
            args = resolve_refs(e.args, f"{path}[{i}].args")  # only checked here, never stored
            try:
                validate_env_spec(e.id, args)
            except ValueError as err:
                raise ConfigError(f"{path}[{i}]", str(err)) from None
            if e.runtime is not None and v1_module(e.id) is None:
                raise ConfigError(
                    f"{path}[{i}].runtime",
                    f"env {e.id!r} is not a verifiers 0.4 (v1) environment; only those run in a runtime",
                )
    return notes


def _alias_notes(cfg: Config) -> list[str]:
    """An env id that runs a built-in under a Hub name is said so at start (never silently)."""
    from hpcrl.envs.registry import alias_note

    o = cfg.orchestrator
    ids = [e.id for e in o.train.env] + ([e.id for e in o.eval.env] if o.eval is not None else [])
    return [n for n in dict.fromkeys(alias_note(i) for i in ids) if n]


def _resolve_warm_start(cfg: Config | SFTConfig) -> None:
    """checkpoint_id / ckpt.warm_start -> the HF weights dir it names, checked against the model, so
    every role reads one absolute path (hpcrl.warm_start)."""
    if cfg.ckpt is None:
        return
    if not cfg.ckpt.warm_start:
        if cfg.ckpt.warm_start_optimizer:
            raise ConfigError("ckpt.warm_start_optimizer", "needs ckpt.warm_start (hosted: checkpoint_id)")
        return
    from hpcrl.warm_start import check_same_adapter, optimizer_source, resolve_for

    ref = cfg.ckpt.warm_start
    sanity.check_path_text(ref, "ckpt.warm_start")  # an OS-refused name is the user's, not an OSError
    cfg.ckpt.warm_start = str(resolve_for(ref, cfg.model.name or ""))
    if cfg.ckpt.warm_start_optimizer:
        model = cfg.trainer.model if isinstance(cfg, Config) and cfg.trainer.model else cfg.model
        lora = msgspec.to_builtins(model.lora) if model.lora is not None else None
        check_same_adapter(optimizer_source(ref)[0], lora)
