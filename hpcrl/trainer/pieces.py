"""The policy as this rank's pieces (hpcrl.weights.shards): what the sharded publish sends.

The same tensors as ``hf_named_tensors`` (same HF names, dtypes, values: tests prove the assembled
policy bit-identical), but each rank yields only the rows it holds:
- an FSDP2 parameter: this rank's run of rows (``to_local()``, offset from its placement);
- stacked experts (the custom MoE): this rank's experts (ep position, and its FSDP rows of them) under
  their per-expert HF names, each expert its own piece;
- LoRA (peft): W's rows merged with B's same rows @ A (A is r x in: gathered, small), cast once;
  a VL MoE's expert LoRA (hpcrl.models.vlm_moe): each held expert's W[e] + s B[e] @ A[e];
- a plain (replicated) tensor: rank 0 only;
- any other layout: gathered (every rank, in step) and sent by rank 0.
Collective under FSDP: every rank must iterate to the end, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from hpcrl.models.load import is_peft_model, parse_dtype
from hpcrl.trainer.model import (
    _full,
    _lora_scalings,
    _strip_peft,
    _tied_names,
)
from hpcrl.weights.shards import Piece, local_rows


def policy_pieces(model: nn.Module, rank: int, *, dtype: str | torch.dtype | None = None) -> Iterator[Piece]:
    """Yield this rank's pieces of the policy, cast to `dtype` (floating tensors), on their device."""
    sd, skip, peft, scalings, adapter = hf_view(model)
    want = parse_dtype(dtype) if dtype is not None else None

    def cast(t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        return t.to(want) if want is not None and t.is_floating_point() else t

    for name, t in sd.items():
        if peft and ".lora_" in name:
            continue
        hf = _strip_peft(name) if peft else name
        got = local_rows(t)
        if got == "gather":
            full = _full(t).detach()
            got = (full, 0) if rank == 0 else None
        elif got is not None and not hasattr(t, "device_mesh") and rank != 0:
            got = None  # a plain tensor: every rank has it, rank 0 sends it
        lora = _lora_of(sd, name, hf, scalings) if peft else None
        if lora is not None:
            # B (out x r) is sharded like W (same dim 0): its local rows are W's; A (r x in) is small
            a_full = _full(lora[0]).detach()
            b_got = local_rows(lora[1])
            b_rows = _full(lora[1]).detach() if b_got == "gather" else None
            if got is None:
                continue
            local, row0 = got
            if b_rows is not None:
                b_loc = b_rows[row0 : row0 + local.shape[0]]
            else:
                assert isinstance(b_got, tuple) and b_got[1] == row0, (name, b_got, row0)
                b_loc = b_got[0]
            merged = local.float() + (b_loc.float() @ a_full.float()) * lora[2]
            got = (merged.to(local.dtype), row0)
        elif peft and hf.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # a VL MoE's expert LoRA
            got = _expert_lora(model, sd, name, got)
        if got is None or hf in skip:
            continue
        local, row0 = got
        if adapter is not None:
            names = [n for n, _ in adapter.to_hf([(hf, torch.empty(tuple(t.shape), device="meta"))])]
            if len(names) > 1:  # stacked experts: this rank's experts, each its own tensor
                for e in range(local.shape[0]):
                    yield Piece(names[row0 + e], tuple(t.shape[1:]), 0, cast(local[e]))
                continue
            hf = names[0]
        yield Piece(hf, tuple(t.shape), row0, cast(local))


def pieces_are_local(model: nn.Module) -> bool:
    """Whether `policy_pieces` builds every piece from this rank's own memory, with no collective (no
    LoRA A to gather, no layout to gather): then it may run lazily between a publish's sends, at a
    different pace on each rank."""
    if is_peft_model(model):
        return False
    return all(local_rows(t) != "gather" for t in model.state_dict().values())


def hf_view(model: nn.Module) -> tuple[dict[str, torch.Tensor], set[str], bool, dict[str, float], Any]:
    """What turns the model's state into HF tensors (as ``hf_named_tensors``): its state dict, the
    tied names to skip, peft or not, the LoRA scalings, and the model family's HF adapter (or None)."""
    peft = is_peft_model(model)
    family = getattr(model, "hpcrl_family", None)
    adapter = None
    if family is not None:
        from hpcrl.models import registry

        adapter = registry.family(family)
    return model.state_dict(), _tied_names(model), peft, _lora_scalings(model) if peft else {}, adapter


def lora_keys(name: str, hf: str, scalings: dict[str, float]) -> tuple[str, str, float] | None:
    """The state keys of LoRA's A and B merged into weight `name` (HF name `hf`) and its scaling."""
    mod = hf.rsplit(".", 1)[0]
    if not (hf.endswith(".weight") and mod in scalings):
        return None
    prefix = name[: -len(".base_layer.weight")] if name.endswith(".base_layer.weight") else mod
    return f"{prefix}.lora_A.default.weight", f"{prefix}.lora_B.default.weight", scalings[mod]


def _lora_of(
    sd: dict[str, torch.Tensor], name: str, hf: str, scalings: dict[str, float]
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    keys = lora_keys(name, hf, scalings)
    return None if keys is None else (sd[keys[0]], sd[keys[1]], keys[2])


def _expert_lora(model: nn.Module, sd: dict, name: str, got: Any) -> Any:
    """This rank's rows of stacked experts with their LoRA merged (hpcrl.models.vlm_moe): A and B
    gathered on every rank (collective, small: E x r x in / out), sliced to the rows held."""
    from hpcrl.models.vlm_moe import expert_lora_of, merge_lora

    found = expert_lora_of(model, name)
    if found is None:
        return got
    whole = {k: _full(sd[k]).detach() for k in found[:2]}
    if got is None:
        return None
    local, row0 = got
    return merge_lora(model, name, local, whole.__getitem__, row0), row0
