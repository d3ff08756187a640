"""Model and tokenizer loading, LoRA, and export of Hugging Face weights.

``hf_named_tensors`` is the single source of "the policy's weights by Hugging Face name": the
weight broadcast and ``export_hf`` both read it, so inference always loads exactly what the trainer
has, whether the model is plain, FSDP-sharded (DTensors, gathered here) or wrapped by peft (LoRA
merged here).
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcrl.fileio import atomic_dir
from hpcrl.models.embeddings import base_model, lm_head

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}
_PEFT_PREFIX = "base_model.model."
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


@dataclass(frozen=True)
class LoraParams:
    """LoRA adapter shape. ``target_modules`` are module-name suffixes (Qwen/Llama projections)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    # Seeds the adapter's random init: every rank must start from the same adapter (FSDP shards
    # each rank's own copy, so different inits would silently mix) and so must a rerun.
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora.rank: {self.rank} must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout: {self.dropout} must be in [0, 1)")
        if not self.target_modules:
            raise ValueError("lora.target_modules must name at least one module")


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"model dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def default_attn_impl(device: torch.device | str) -> str:
    """flash_attention_2 on CUDA when flash-attn is installed, else PyTorch SDPA (CPU, tests)."""
    if torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def load_model(
    path: str | os.PathLike[str],
    dtype: str | torch.dtype = "float32",
    device: torch.device | str = "cpu",
    attn_impl: str | None = None,
    activation_checkpointing: bool = False,
    activation_offload: bool = False,
    lora: LoraParams | None = None,
    trust_remote_code: bool = False,
    meta: bool = False,
    impl: str = "hf",
) -> nn.Module:
    """Load a causal LM from a local Hugging Face directory, ready to train (``train()`` mode).

    ``impl``: 'hf' (transformers), 'custom' (hpcrl.models.registry's own implementation; no LoRA) or
    'auto' (custom where one exists and no LoRA is asked for).

    ``meta``: build the same architecture (and LoRA adapter) on the meta device without reading any
    weight: it costs no memory, and ``parallel.fill_from_rank0`` fills it after sharding.

    ``activation_offload`` (with ``activation_checkpointing``): what each checkpointed decoder layer
    keeps for its backward (its input) is packed into pinned CPU memory by
    ``torch.autograd.graph.save_on_cpu`` and copied back when the layer is recomputed; meant for CUDA
    (on CPU it only copies). The caller decides the device (the trainer passes it for CUDA only)."""
    if activation_offload and not activation_checkpointing:
        raise ValueError(
            "activation_offload needs activation_checkpointing (it offloads the checkpointed inputs)"
        )
    from transformers import AutoConfig, AutoModelForCausalLM

    if not Path(path, "config.json").is_file():
        raise ValueError(f"model path {str(path)!r} is not a Hugging Face model directory (no config.json)")
    from hpcrl.models import registry

    hf_config = registry.config_of(path)
    model_type = str(hf_config.get("model_type", ""))
    attn_asked = attn_impl
    # attn auto on a GPU without FA3: a dense model keeps transformers' FA2 varlen kernel where
    # flash-attn is installed (the custom model would run SDPA with dense masks there)
    gpu_without_fa3 = (
        torch.device(device).type == "cuda" and importlib.util.find_spec("flash_attn_interface") is None
    )
    if attn_impl is None and impl == "auto" and not model_type.endswith("_moe") and gpu_without_fa3:
        attn_asked = default_attn_impl(device)
    if (
        registry.pick_impl(impl, model_type, lora=lora is not None, attn=attn_asked, config=hf_config)
        == "custom"
    ):
        from hpcrl.models.custom import load_custom

        return load_custom(
            path,
            parse_dtype(dtype),
            device,
            attn_impl or "auto",
            activation_checkpointing,
            meta,
            offload=activation_offload,
        )
    kwargs = {
        "dtype": parse_dtype(dtype),
        "attn_implementation": attn_impl or default_attn_impl(device),
        "trust_remote_code": trust_remote_code,
    }
    if meta:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
        model.to(device)
    # The KV cache is useless for training forwards and conflicts with checkpointing.
    model.config.use_cache = False
    if activation_checkpointing:
        enable_checkpointing(model, activation_offload)
    if lora is not None:
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = apply_lora(model, lora)
    model.train()
    return model


def enable_checkpointing(model: nn.Module, offload: bool) -> None:
    """transformers' activation checkpointing of every decoder layer, non-reentrant (it composes with
    FSDP2 and with frozen LoRA base weights); ``offload``: each layer's ``checkpoint`` call runs
    inside ``torch.autograd.graph.save_on_cpu(pin_memory=True)``, so the inputs it saves go to pinned
    CPU memory. (transformers >= 5.2x has ``activation_checkpointing_enable(offload=True)`` for the same
    wrapper, but it asks for pinned memory on CPU-only machines too, where torch refuses; ours leaves
    pinning to torch's CUDA check and works with every transformers version.)"""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if not offload:
        return
    wrapped = 0
    for mod in model.modules():
        inner = getattr(mod, "_gradient_checkpointing_func", None)
        if inner is not None:
            mod._gradient_checkpointing_func = _offloading(inner)
            wrapped += 1
    if not wrapped:
        raise ValueError(f"activation_offload: {type(model).__name__} has no checkpointed layers to offload")


def _offloading(checkpoint_fn: Any) -> Any:
    from torch.autograd.graph import save_on_cpu

    def run(*args: Any, **kwargs: Any) -> Any:
        with save_on_cpu(pin_memory=True):
            return checkpoint_fn(*args, **kwargs)

    return run


def apply_lora(model: nn.Module, lora: LoraParams) -> nn.Module:
    """Wrap with a peft LoRA adapter; only adapter weights stay trainable."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ValueError("LoRA needs the 'peft' package: pip install 'hpcrl[lora]'") from e
    cfg = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.target_modules),
        task_type="CAUSAL_LM",
    )
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing:
        # Checkpointed blocks need an input that requires grad when the embeddings are frozen.
        model.enable_input_require_grads()
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(lora.seed)
        return get_peft_model(model, cfg)


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def load_tokenizer(path: str | os.PathLike[str], trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)


def _full(t: torch.Tensor) -> torch.Tensor:
    """Whole tensor from a possibly sharded DTensor (collective for DTensors: every rank calls it)."""
    if hasattr(t, "full_tensor"):
        return t.full_tensor()
    return t


def _lora_scalings(model: nn.Module) -> dict[str, float]:
    """``{module path (HF naming): scaling}`` of every LoRA layer, for merging without peft's help."""
    out: dict[str, float] = {}
    for name, mod in model.named_modules():
        scaling = getattr(mod, "scaling", None)
        if isinstance(scaling, dict) and hasattr(mod, "lora_A") and "default" in scaling:
            out[_strip_peft(name)] = float(scaling["default"])
    return out


def _strip_peft(name: str) -> str:
    if name.startswith(_PEFT_PREFIX):
        name = name[len(_PEFT_PREFIX) :]
    return name.replace(".base_layer", "")


def hf_named_tensors(
    model: nn.Module, *, device: str = "cpu", dtype: str | torch.dtype | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for every weight, in a fixed order, one tensor at a time.

    FSDP shards are gathered (collective: EVERY rank must iterate to the end, in step); LoRA is
    merged into the base weights (W + B @ A * scaling) and adapter tensors are not yielded. Tied
    weights appear once (the name ``save_pretrained`` keeps). ``dtype`` casts floating tensors (the
    policy inference loads is the compute dtype, e.g. bf16 over fp32 master weights)."""
    sd = model.state_dict()
    skip = _tied_names(model)
    want = parse_dtype(dtype) if dtype is not None else None

    def out(t: torch.Tensor) -> torch.Tensor:
        if want is not None and t.is_floating_point():
            return t.to(device=device, dtype=want)
        return t.to(device)

    if not is_peft_model(model):
        named = ((name, _full(t).detach()) for name, t in sd.items())
        family = getattr(model, "hpcrl_family", None)
        if family is not None:  # the custom implementation: stacked experts -> per-expert HF names
            from hpcrl.models import registry

            named = registry.family(family).to_hf(named)
        for name, full in named:
            if name not in skip:
                yield name, out(full)
        return
    scalings = _lora_scalings(model)
    for name, t in sd.items():
        if ".lora_" in name:
            continue
        hf = _strip_peft(name)
        full = _full(t).detach()
        mod = hf.rsplit(".", 1)[0]
        if hf.endswith(".weight") and mod in scalings:
            prefix = name[: -len(".base_layer.weight")] if name.endswith(".base_layer.weight") else mod
            a = _full(sd[f"{prefix}.lora_A.default.weight"]).detach()
            b = _full(sd[f"{prefix}.lora_B.default.weight"]).detach()
            full = (full.float() + (b.float() @ a.float()) * scalings[mod]).to(full.dtype)
        if hf not in skip:
            yield hf, out(full)


def _tied_names(model: nn.Module) -> set[str]:
    """Names dropped when the input and output embeddings are tied (lm_head shares embed_tokens)."""
    base = base_model(model)
    cfg = getattr(base, "config", None)
    if cfg is None or not getattr(cfg, "tie_word_embeddings", False):
        return set()
    out_emb = lm_head(model)
    if out_emb is None:
        return set()
    names = {n for n, m in base.named_modules() if m is out_emb}
    return {f"{n}.weight" for n in names}


def merged_state_dict(model: nn.Module, dtype: str | torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Full HF-named state dict on CPU (LoRA merged, shards gathered). Collective under FSDP."""
    return dict(hf_named_tensors(model, dtype=dtype))


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA adapter's tensors under peft's file names (what adapter_model.safetensors holds), on CPU.
    Under FSDP every rank must call it (the adapter shards are gathered)."""
    if not is_peft_model(model):
        raise ValueError("the model has no LoRA adapter")
    from peft import get_peft_model_state_dict

    return {k: _full(v).detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(model).items()}


def adapter_config(model: nn.Module) -> dict[str, Any]:
    """The adapter's peft config as JSON (what adapter_config.json holds): sent with a broadcast adapter."""
    cfg = model.peft_config["default"].to_dict()
    return json.loads(json.dumps(cfg, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def save_adapter(model: nn.Module, out_dir: str | os.PathLike[str], *, write: bool = True) -> Path:
    """Write only the LoRA adapter in peft's format (adapter_config.json + adapter_model.safetensors),
    loadable with ``PeftModel.from_pretrained``. Atomic; under FSDP every rank must call it (the
    adapter shards are gathered) with ``write = is_rank0()``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    tensors = adapter_tensors(model)
    if not write:
        return out
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        model.peft_config["default"].save_pretrained(str(tmp))
    return out


def export_hf(
    model: nn.Module,
    tokenizer: Any,
    out_dir: str | os.PathLike[str],
    *,
    write: bool = True,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    dtype: str | torch.dtype | None = None,
    tensors: Iterator[tuple[str, torch.Tensor]] | None = None,
) -> Path:
    """Write a Hugging Face model directory that ``AutoModelForCausalLM.from_pretrained`` loads.

    Atomic: everything goes to a temporary sibling directory that is renamed into place, so a reader
    never sees a partial export. Under FSDP every rank must call this (weights are gathered); pass
    ``write = is_rank0()`` so only one rank touches the filesystem. ``dtype``: floating weights are
    written in it and config.json says so (the published policy's dtype). ``tensors``: the (name,
    tensor) pairs to write instead of ``hf_named_tensors`` (hpcrl.trainer.stream streams them to rank 0
    without a gather; every rank must still run it to the end). Each safetensors file is written as
    soon as it holds ``max_shard_bytes``: the writer holds at most one file's tensors."""
    out = Path(out_dir)
    if tensors is None:
        tensors = hf_named_tensors(model, dtype=dtype)
    if not write:
        for _ in tensors:  # take part in the gathers
            pass
        return out
    with atomic_dir(out) as tmp:
        write_weight_files(tmp, tensors, max_shard_bytes)
        save_hf_meta(model, tokenizer, tmp, dtype)
    return out


def write_weight_files(
    out: Path, tensors: Iterator[tuple[str, torch.Tensor]], max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> None:
    """Write (name, tensor) pairs into `out` as HF safetensors: model.safetensors, or numbered files
    + model.safetensors.index.json. A file is written as soon as it holds `max_shard_bytes`: the
    writer holds at most one file's tensors."""
    from safetensors.torch import save_file

    shard: dict[str, torch.Tensor] = {}
    files: list[tuple[str, list[str]]] = []
    size = total = 0

    def flush() -> None:
        part = f"part-{len(files):05d}.safetensors"
        save_file(shard, str(out / part), metadata={"format": "pt"})
        files.append((part, list(shard)))
        shard.clear()

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
            size = 0
        shard[name] = t.contiguous()
        size += nbytes
        total += nbytes
    if shard or not files:
        flush()
    if len(files) == 1:
        (out / files[0][0]).rename(out / "model.safetensors")
        return
    weight_map = {}
    for i, (part, names) in enumerate(files):
        fname = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        (out / part).rename(out / fname)
        weight_map.update(dict.fromkeys(names, fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def save_hf_meta(model: nn.Module, tokenizer: Any, out: Path, dtype: str | torch.dtype | None) -> None:
    """config.json (saying `dtype` when given: the weights' dtype), generation_config.json and the
    tokenizer's files: what an HF directory holds besides its weights."""
    base = base_model(model)
    cfg = base.config
    if dtype is not None:
        cfg = copy.deepcopy(cfg)
        cfg.dtype = parse_dtype(dtype)
    cfg.save_pretrained(str(out))
    gen = getattr(base, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
