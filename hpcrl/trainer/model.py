"""Export of Hugging Face weights and LoRA adapters from a trained model (the model itself is built by
its family spec, :mod:`hpcrl.models.spec`; the tokenizer is :mod:`hpcrl.models.tokenizer`).

``hf_named_tensors`` is the single source of "the policy's weights by Hugging Face name": the
weight broadcast and ``export_hf`` both read it, so inference always loads exactly what the trainer
has, whether the model is plain, FSDP-sharded (DTensors, gathered here) or wrapped by peft (LoRA
merged here).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcrl.fileio import atomic_dir
from hpcrl.models.embeddings import base_model, lm_head
from hpcrl.models.load import is_peft_model, parse_dtype

_PEFT_PREFIX = "base_model.model."
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


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
        elif hf.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # a VL MoE's expert LoRA
            from hpcrl.models.vlm_moe import merge_lora

            full = merge_lora(model, name, full, lambda k: _full(sd[k]).detach())
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


def adapter_sync(model: nn.Module) -> tuple[bool, str]:
    """LoRA RL: may the policies after the first (full, merged) one travel as the adapter alone, and
    why not. Not when the model has expert LoRA (hpcrl.models.vlm_moe: outside peft's adapter, so
    only the merged weights carry it), nor when the adapter is already trained (a resume: the first
    policy then holds W + s B_k A_k, and a server merging adapter k+1 onto it would apply both).
    Collective under torch.distributed (every trainer rank calls it: they agree)."""
    from hpcrl.models.vlm_moe import has_expert_lora

    if has_expert_lora(model):
        return False, "the stacked experts' LoRA is not in peft's adapter"
    trained = any(
        bool((p.to_local() if hasattr(p, "to_local") else p).detach().ne(0).any())
        for n, p in model.named_parameters()
        if ".lora_B." in n
    )
    flag = torch.tensor([float(trained)])
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_backend() == "nccl":
            flag = flag.cuda()
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if flag.item():
        return False, "the adapter is trained already (a resume): servers hold it merged"
    return True, ""


def adapter_config(model: nn.Module) -> dict[str, Any]:
    """The adapter's peft config as JSON (what adapter_config.json holds): sent with a broadcast adapter."""
    cfg = model.peft_config["default"].to_dict()
    return json.loads(json.dumps(cfg, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def save_adapter(model: nn.Module, out_dir: str | os.PathLike[str], *, write: bool = True) -> Path:
    """Write only the LoRA adapter in peft's format (adapter_config.json + adapter_model.safetensors),
    loadable with ``PeftModel.from_pretrained``. Atomic; under FSDP every rank must call it (the
    adapter shards are gathered) with ``write = is_rank0()``."""
    tensors = adapter_tensors(model)
    if write:
        write_adapter(model, tensors, out_dir)
    return Path(out_dir)


def write_adapter(
    model: nn.Module, tensors: dict[str, torch.Tensor], out_dir: str | os.PathLike[str]
) -> Path:
    """The writing half of save_adapter (rank-local: `tensors` from adapter_tensors). Atomic: a tmp
    directory renamed last, so a try cut short (a refused write, retried under hpcrl.storage) leaves
    no adapter a reader takes for complete."""
    from safetensors.torch import save_file

    out = Path(out_dir)
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
        image_processor = getattr(tokenizer, "hpcrl_image_processor", None)  # vision-language SFT
        if image_processor is not None:
            image_processor.save_pretrained(str(out))
