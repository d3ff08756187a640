"""One construction path per model family, as torchtitan's TrainSpec: a :class:`ModelSpec` per family,
reached through the registry (:func:`spec_for`), owns everything that builds a trained model.

- ``config_args``: the family's arguments from a model directory (config.json's dict);
- ``unsupported`` (checks): what of a config it does not compute (None: it runs it);
- ``build``: the module in the master dtype on a device or on the meta device, attention kernel
  chosen once, activation checkpointing and LoRA applied (:mod:`hpcrl.models.load`);
- ``parallelize``: expert parallelism (the family's ``apply_ep``), then cp, FSDP2 and vocab-parallel
  (:func:`hpcrl.models.parallelize.parallelize`);
- ``from_hf`` / ``to_hf``: the state-dict adapter (Hugging Face names <-> the module's).

Families: hpcrl's own Qwen3 / Qwen3-MoE (``hpcrl.models.qwen3.SPEC``, impl = custom), and every other
causal LM through transformers (:data:`HF`, the generic path). The built-in tiny test models
(:mod:`hpcrl.models.tiny`) are Qwen3 / Qwen3-MoE directories: they take the same two paths.

:func:`build` is the one path the trainers call: spec, build (rank 0 only reads weights when sharded
over several ranks; the others build on meta), warm start, parallelize, fill from rank 0.
This module imports torch only inside functions (the qwen3 family's package imports it for its spec).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpcrl.models import registry

if TYPE_CHECKING:
    import torch
    from torch import nn

    from hpcrl.config.schema import TrainerModelConfig
    from hpcrl.models.parallelize import CPGroup


def _same(x: Any) -> Any:
    return x


def _no_reason(_config: dict[str, Any]) -> str | None:
    return None


@dataclass(frozen=True)
class ModelSpec:
    """How one family of models is built and parallelized for training."""

    name: str
    model_types: tuple[str, ...]  # HF config.model_type values it serves; () = any (the generic path)
    build: Callable[..., nn.Module]  # (path, *, dtype, device, attn, activation_checkpointing, ...)
    apply_ep: Callable[..., set] | None = None  # (model, ep, device, param_dtype, reduce_dtype) -> experts
    from_hf: Callable[[dict], dict] = _same
    to_hf: Callable[[Iterable], Iterable] = _same
    unsupported: Callable[[dict[str, Any]], str | None] = _no_reason
    config_args: Callable[[str | os.PathLike[str]], dict[str, Any]] = field(default=registry.config_of)

    def parallelize(
        self,
        model: nn.Module,
        *,
        device: torch.device,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        force: bool = False,
        ep: int = 1,
        cp: CPGroup | None = None,
        vocab_parallel: bool = True,
    ) -> nn.Module:
        """ep (the family's), cp, FSDP2 and vocab-parallel on a built model. Collective."""
        from hpcrl.models.parallelize import parallelize

        experts: set = set()
        apply_ep = self.apply_ep
        if ep > 1 and apply_ep is None:  # transformers' VL MoE with hpcrl's MoE blocks (models.vlm_moe)
            from hpcrl.models.vlm_moe import has_swapped_moe

            if has_swapped_moe(model):
                from hpcrl.models.qwen3.parallelize import apply_ep
        if ep > 1:
            if apply_ep is None:
                from hpcrl.errors import ConfigError

                raise ConfigError(
                    "trainer.model.ep",
                    f"{ep} needs the custom implementation of a MoE model "
                    f"(impl = 'custom' or 'auto'; this run uses transformers')",
                )
            experts = apply_ep(model, ep, device, param_dtype, reduce_dtype)
        return parallelize(
            model,
            param_dtype=param_dtype,
            reduce_dtype=reduce_dtype,
            force=force or bool(experts),
            experts=experts,
            cp=cp,
            vocab_parallel=vocab_parallel,
        )


def _build_hf(path: Any, **kw: Any) -> nn.Module:
    from hpcrl.models.load import build_hf

    return build_hf(path, **kw)


HF = ModelSpec(name="hf", model_types=(), build=_build_hf)


def family_spec(model_type: str) -> ModelSpec | None:
    """The spec of hpcrl's own implementation of ``model_type`` (None: there is none)."""
    fam = registry.family(model_type)
    return None if fam is None else fam.SPEC


def spec_of(model: Any) -> ModelSpec:
    """The spec that built ``model`` (the generic one for transformers' models)."""
    model_type = getattr(model, "hpcrl_family", None)
    return HF if model_type is None else family_spec(model_type) or HF


def spec_for(
    path: str | os.PathLike[str],
    impl: str = "hf",
    *,
    lora: bool = False,
    attn: str | None = None,
    device: Any = "cpu",
) -> ModelSpec:
    """The spec that builds the model at ``path`` for ``impl`` (hf | custom | auto): the registry's
    choice (:func:`registry.pick_impl`), with LoRA on transformers' model (peft)."""
    import importlib.util

    import torch

    config = registry.config_of(path)
    model_type = str(config.get("model_type", ""))
    attn_asked = attn
    # attn auto on a GPU without FA3: a dense model keeps transformers' FA2 varlen kernel where
    # flash-attn is installed (the custom model would run SDPA with dense masks there)
    gpu_without_fa3 = (
        torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn_interface") is None
    )
    if attn is None and impl == "auto" and not model_type.endswith("_moe") and gpu_without_fa3:
        from hpcrl.models.load import default_attn_impl

        attn_asked = default_attn_impl(device)
    picked = registry.pick_impl(impl, model_type, lora=lora, attn=attn_asked, config=config)
    spec = family_spec(model_type) if picked == "custom" else HF
    assert spec is not None, model_type
    return spec


def load_model(
    path: str | os.PathLike[str],
    dtype: Any = "float32",
    device: Any = "cpu",
    attn_impl: str | None = None,
    activation_checkpointing: bool = False,
    activation_offload: bool = False,
    lora: Any = None,
    trust_remote_code: bool = False,
    meta: bool = False,
    impl: str = "hf",
) -> nn.Module:
    """Load a causal LM from a local Hugging Face directory, ready to train (``train()`` mode),
    through its family spec's ``build`` (:func:`spec_for`), not parallelized (:func:`build` is
    the trainer's whole path).

    ``impl``: 'hf' (transformers), 'custom' (hpcrl.models.registry's own implementation; no LoRA) or
    'auto' (custom where one exists and no LoRA is asked for).

    ``meta``: build the same architecture (and LoRA adapter) on the meta device without reading any
    weight: it costs no memory, and ``parallelize.fill_from_rank0`` fills it after sharding.

    ``activation_offload`` (with ``activation_checkpointing``): what each checkpointed decoder layer
    keeps for its backward (its input) is packed into pinned CPU memory by
    ``torch.autograd.graph.save_on_cpu`` and copied back when the layer is recomputed; meant for CUDA
    (on CPU it only copies). The caller decides the device (the trainer passes it for CUDA only)."""
    from hpcrl.models.load import check_model_dir, check_offload, parse_dtype

    check_offload(activation_checkpointing, activation_offload)
    check_model_dir(path)
    spec = spec_for(path, impl, lora=lora is not None, attn=attn_impl, device=device)
    return spec.build(
        path,
        dtype=parse_dtype(dtype),
        device=device,
        attn=attn_impl,
        activation_checkpointing=activation_checkpointing,
        activation_offload=activation_offload,
        lora=lora,
        trust_remote_code=trust_remote_code,
        meta=meta,
    )


def attn_for(model_cfg: TrainerModelConfig) -> str | None:
    """The attention the model is built with: chosen once, here; a cp kernel under cp (ring or
    Ulysses, registered with transformers too), else ``trainer.model.attn`` (None: the family's default)."""
    if model_cfg.cp > 1 and model_cfg.cp_mode == "ulysses":
        from hpcrl.models import ulysses

        return ulysses.register_hf()
    if model_cfg.cp > 1:
        from hpcrl.models.ring_attention import register_hf

        return register_hf()
    return None if model_cfg.attn == "auto" else model_cfg.attn


def lora_of(model_cfg: TrainerModelConfig) -> Any:
    """``trainer.model.lora`` as :class:`hpcrl.models.load.LoraParams` (None: no LoRA)."""
    if model_cfg.lora is None:
        return None
    from hpcrl.models.load import LoraParams

    lc = model_cfg.lora
    return LoraParams(
        rank=lc.rank, alpha=lc.alpha, dropout=lc.dropout, target_modules=tuple(lc.target_modules)
    )


@dataclass(frozen=True)
class Mesh:
    """The process layout a model is parallelized over (the trainer makes the groups)."""

    device: Any  # this rank's torch.device
    world: int = 1
    rank: int = 0
    cp: CPGroup | None = None  # this rank's context-parallel group (trainer.model.cp > 1)


@dataclass(frozen=True)
class Dtypes:
    """Master (stored), compute (FSDP's param dtype) and gradient-reduce dtypes; ``mixed``: compute
    differs from master, so FSDP shards even a world of one."""

    master: Any
    compute: Any
    reduce: Any
    mixed: bool = False


def build(
    model_cfg: TrainerModelConfig,
    path: str,
    mesh: Mesh,
    dtypes: Dtypes,
    *,
    warm_start: str | None = None,
    meta_init: bool = True,
    read_weights: Callable[[str], dict[str, torch.Tensor]] | None = None,
    prepare: Callable[[nn.Module], object] | None = None,
) -> nn.Module:
    """The trainable model, parallelized: the one construction path. Over several ranks with
    ``meta_init``, only rank 0 reads the weights (into CPU memory): the others build the model on the
    meta device, every rank parallelizes it, and rank 0 broadcasts one tensor at a time, each rank
    keeping its rows. Rank 0 then drops its whole copy, so no rank holds more than one model plus its
    shard at any moment. ``read_weights`` reads a warm start's HF-named tensors (the trainer passes
    one that also reads a checkpoint step dir without HF weights); default: a dir of safetensors.
    ``prepare`` runs on the built model before it is parallelized: the trainer's memory savers
    (activation checkpointing, compile, offloading: hpcrl.trainer.memory_savers), which this path
    leaves to it. Collective."""
    from hpcrl.models import parallelize as par
    from hpcrl.models.load import load_warm_start, parse_dtype

    lora = lora_of(model_cfg)
    registry.refuse_lora_on_custom(model_cfg.impl, lora is not None)  # before a warm start drops `lora`
    if lora is not None and getattr(model_cfg, "vlm", None) is not None and "experts" in lora.target_modules:
        import dataclasses  # a VL MoE's stacked experts: hpcrl.models.vlm_moe's LoRA, not peft's

        lora = dataclasses.replace(
            lora, target_modules=tuple(t for t in lora.target_modules if t != "experts")
        )
    from_rank0 = meta_init and mesh.world > 1
    on_meta = from_rank0 and mesh.rank != 0
    device = mesh.device
    load_device = "cpu" if from_rank0 else device
    attn = attn_for(model_cfg)
    # LoRA (also when a warm start applies it after loading) runs on transformers' model (peft)
    impl = model_cfg.impl if lora is None else "hf"
    spec = spec_for(path, impl, lora=lora is not None, attn=attn, device=load_device)
    model = spec.build(
        path,
        dtype=parse_dtype(dtypes.master),
        device=load_device,
        attn=attn,
        lora=None if warm_start else lora,
        trust_remote_code=model_cfg.trust_remote_code,
        meta=on_meta,
        **({"vision": True} if getattr(model_cfg, "vlm", None) is not None else {}),  # sft's [model.vlm]
    )
    if warm_start:
        # Into the base model, before LoRA wraps it: the weights dir holds HF names (a LoRA run's are
        # merged), and the new adapter starts at zero on top of them. Meta ranks get it from rank 0.
        if not on_meta:
            load_warm_start(model, warm_start, read_weights)
        if lora is not None:
            from hpcrl.models.load import apply_lora

            model = apply_lora(model, lora)
    if prepare is not None:
        prepare(model)
    whole = par.local_tensors(model) if from_rank0 and not on_meta else {}
    model = spec.parallelize(
        model,
        device=device,
        param_dtype=parse_dtype(dtypes.compute),
        reduce_dtype=parse_dtype(dtypes.reduce),
        force=dtypes.mixed,
        ep=model_cfg.ep,
        cp=mesh.cp,
        vocab_parallel=model_cfg.vocab_parallel,
    )
    if from_rank0:
        if on_meta:
            model.to_empty(device=device)
        par.fill_from_rank0(model, whole)  # consumes rank 0's whole copy, tensor by tensor
    return model
