"""Parallelizing a built model, for every family: FSDP2, context parallelism (the cp group bound to
the attention), the vocabulary-parallel embedding and head, and the meta-device fill from rank 0.

The family spec (:mod:`hpcrl.models.spec`) calls these in one order (:func:`parallelize`): the
family's expert parallelism first (its experts then stay out of the outer FSDP), the cp group onto
every attention module, FSDP over all ranks with the vocabulary-parallel weights left out, then those
weights split within each cp group. The trainer only makes the process groups (its "mesh": the world,
the cp groups) and passes them in.

Gradients are SUM-reduced across ranks (not averaged): the loss of every rank is already divided
by the step's global loss-token count, so summing gradients gives exactly the gradient of one big
batch, however samples are spread over ranks and micro-batches.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpcrl.models.embeddings import embeddings

log = logging.getLogger("hpcrl.trainer")


@dataclass(frozen=True)
class CPGroup:
    """This rank's context-parallel group (``trainer.model.cp``): ranks ``g*cp .. g*cp+cp-1``."""

    size: int
    rank: int  # this rank's index in its cp group
    group: Any  # torch.distributed process group of the cp group
    members: tuple[int, ...]  # global ranks of the group, in cp order


def make_cp_group(cp: int) -> CPGroup:
    """The cp group of this rank (every rank must call this: new_group is collective)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % cp:
        raise ValueError(f"trainer.model.cp = {cp} must divide the number of trainer ranks ({world})")
    mine = None
    for g in range(world // cp):
        members = tuple(range(g * cp, (g + 1) * cp))
        pg = dist.new_group(list(members))
        if rank in members:
            mine = CPGroup(cp, rank - g * cp, pg, members)
    assert mine is not None
    return mine


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_expert_sharded(t: torch.Tensor) -> bool:
    """A DTensor on an ``ep`` mesh (an expert parameter or its gradient under expert parallelism)."""
    mesh = getattr(t, "device_mesh", None)
    return mesh is not None and "ep" in (mesh.mesh_dim_names or ())


VISION_PARTS = ("visual", "vision_tower", "vision_model", "vision_encoder", "image_encoder")
VISION_MARK = "_hpcrl_vision_encoder"  # set on the module [model.vlm] names (hpcrl.trainer.sft_vlm)
LANGUAGE_MARK = "_hpcrl_language_model"


def _marked(model: nn.Module, mark: str) -> list[str]:
    """The dotted names of the modules carrying `mark` (a plain attribute: it survives peft's wrapping)."""
    return [name for name, mod in model.named_modules() if getattr(mod, mark, False)]


def _under(name: str, roots: list[str]) -> bool:
    return any(name == r or name.startswith(r + ".") or not r for r in roots)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the largest ``ModuleList`` whose name ends in ``layers`` (HF models
    call it ``model.layers``; peft nests it under ``base_model.model``). A vision-language model's
    vision blocks are never taken for them: Qwen2.5-VL-7B's vision tower has 32 blocks to its language
    model's 28 layers, and the longest list would shard the tower and leave the language model whole
    in the root unit. The modules [model.vlm] names decide (the language model's lists only, never
    the encoder's); without them, paths through VISION_PARTS are left out."""
    vision, language = _marked(model, VISION_MARK), _marked(model, LANGUAGE_MARK)
    best: nn.ModuleList | None = None
    for name, mod in model.named_modules():
        if not (isinstance(mod, nn.ModuleList) and name.split(".")[-1] in ("layers", "h", "blocks")):
            continue
        if _under(name, vision) if vision else any(p in VISION_PARTS for p in name.split(".")):
            continue
        if language and not _under(name, language):
            continue
        if best is None or len(mod) > len(best):
            best = mod
    if best is None:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return list(best)


def untied_input_embeddings(model: nn.Module) -> nn.Module | None:
    """The input embedding module when its weight is not the LM head's (an untied model: Qwen3-8B and
    larger); None when tied or when the model has no such accessors."""
    emb, head = embeddings(model)
    if emb is None or head is None or emb.weight is head.weight:
        return None
    return emb


# ------------------------------------------------------------------------------------------ cp
def apply_cp(model: nn.Module, group: Any) -> int:
    """Bind the cp process group to every decoder layer's attention module (hpcrl's own and
    transformers' alike): the cp kernels read it from the module they run for, and the micro-batch's
    layout comes with each forward (``cp_batch=``). Returns how many modules were bound. A layer
    without such a module is left alone: a cp kernel run on an unbound module refuses to attend
    (``ring_attention.cp_group_of``), so nothing computes over its own slice alone unnoticed."""
    from hpcrl.models.ring_attention import bind_cp_group

    bound = 0
    for layer in decoder_layers(model):
        attn = next(
            (getattr(layer, n) for n in ("self_attn", "attn", "attention") if hasattr(layer, n)), None
        )
        if attn is not None:
            bind_cp_group(attn, group)
            bound += 1
    return bound


# ---------------------------------------------------------------------------------------- FSDP2
def apply_fsdp(
    model: nn.Module,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    force: bool = False,
    ignored_params: set[nn.Parameter] | None = None,
) -> nn.Module:
    """FSDP2 ``fully_shard`` on every decoder layer, an untied input embedding on its own, then the
    root (final norm, lm_head, and a tied embedding, which the head needs). A world of 1 is returned as is
    unless ``force`` (sharding over one rank costs time and buys nothing).

    ``param_dtype`` enables mixed precision (e.g. bf16 compute over fp32 master weights).
    ``ignored_params``: left alone (expert-parallel experts, sharded over their own mesh)."""
    if _world() == 1 and not force:
        return model
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in decoder_layers(model):
        fully_shard(
            layer, mp_policy=mp, reshard_after_forward=reshard_after_forward, ignored_params=ignored_params
        )
    emb = untied_input_embeddings(model)
    if emb is not None and not (ignored_params and emb.weight in ignored_params):
        # Its own group: gathered for the first op of the forward and the last of the backward only.
        # In the root group it was gathered through the whole forward (the root's forward is the
        # model's) and the whole backward (from the LM head's to its own), i.e. through the step's
        # peak at the LM head: vocab x hidden in the compute dtype (1.2 GB bf16 at Qwen3-8B).
        fully_shard(emb, mp_policy=mp, reshard_after_forward=True, ignored_params=ignored_params)
    fully_shard(
        model, mp_policy=mp, reshard_after_forward=reshard_after_forward, ignored_params=ignored_params
    )
    for mod in model.modules():
        if isinstance(mod, FSDPModule):
            # Sum, not mean: see the module docstring. A divide factor alone would use NCCL's
            # PREMUL_SUM, which gloo lacks; forcing sum-type comms makes it a plain SUM on both.
            # Neither setter recurses in torch, hence the loop over every FSDP module.
            mod.set_gradient_divide_factor(1.0)
            mod.set_force_sum_reduction_for_comms(True)
    return model


def parallelize(
    model: nn.Module,
    *,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None = torch.float32,
    force: bool = False,
    experts: set | None = None,
    cp: CPGroup | None = None,
    vocab_parallel: bool = True,
) -> nn.Module:
    """cp, FSDP2 and vocab-parallel on a built model (after the family's expert parallelism, whose
    ``experts`` FSDP leaves alone): the cp group bound to the attention (:func:`apply_cp`), FSDP2 over
    all ranks (:func:`apply_fsdp`), and under ``cp`` with ``vocab_parallel`` the input embedding and
    LM head split over the vocabulary within each cp group (:mod:`hpcrl.models.vocab_parallel`; said
    in one line when the model's layers cannot be). Collective."""
    vocab: set = set()
    if cp is not None:
        apply_cp(model, cp.group)
    if cp is not None and vocab_parallel:
        from hpcrl.models import vocab_parallel as vp

        why = vp.supported(model)
        if why is None:
            vocab = vp.parameters(model)
        else:
            log.info("trainer.model.vocab_parallel: off, %s; FSDP gathers the embedding and head whole", why)
    ignored = (experts or set()) | vocab
    model = apply_fsdp(
        model, param_dtype=param_dtype, reduce_dtype=reduce_dtype, force=force, ignored_params=ignored or None
    )
    if vocab and cp is not None:
        vs = vp.shard(model, cp.size, cp.rank, cp.group, param_dtype)
        log.info(
            "vocab-parallel embedding and LM head: %d of %d rows per rank within the cp group (FSDP "
            "leaves them alone)",
            vs.dp * vs.block,
            vs.vocab,
        )
    return model


# ------------------------------------------------------------------------------ meta-device init
def _comm_device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def row_range(t: torch.Tensor) -> tuple[list[int], int, int]:
    """(global shape, first row, row count) of the part of ``t`` this rank holds. A DTensor sharded
    by FSDP2 holds ``torch.chunk(whole, world, dim=0)[rank]``; expert-parallel experts FSDP-sharded
    within their ep position (``Shard(0)`` over ep, then FSDP over dp_ep) hold one contiguous run of
    rows too; a plain tensor holds everything."""
    shape = list(t.shape)
    if not hasattr(t, "device_mesh") or t.dim() == 0:
        return shape, 0, shape[0] if shape else 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local_rows = t.to_local().shape[0]
    assert list(local_shape[1:]) == shape[1:] and not any(offset[1:]), (
        f"only dim-0 sharding is supported, got {t.placements}"
    )
    assert local_shape[0] == local_rows, (shape, t.placements, local_shape, local_rows)
    return shape, int(offset[0]) if local_rows else min(int(offset[0]), shape[0]), local_rows


def local_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones too, e.g. rotary ``inv_freq``) by name, each
    shared tensor once (tied embeddings). References, not copies."""
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    return out


def _same_structure(named: dict[str, torch.Tensor]) -> bool:
    """Whether every rank has the same tensor names, global shapes and dtypes (collective)."""
    import hashlib

    sig = "\n".join(f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in named.items()).encode()
    mine = torch.frombuffer(bytearray(hashlib.sha256(sig).digest()), dtype=torch.uint8).to(_comm_device())
    ref = mine.clone()
    dist.broadcast(ref, src=0)
    differs = torch.tensor(float(not torch.equal(mine, ref)), device=_comm_device())
    dist.all_reduce(differs, op=dist.ReduceOp.MAX)
    return bool(differs.item() == 0)


@torch.no_grad()
def fill_from_rank0(model: nn.Module, full: MutableMapping[str, torch.Tensor]) -> None:
    """Fill a sharded model from rank 0's whole tensors ``full`` (``local_tensors`` of the model
    rank 0 loaded, taken before sharding; ``{}`` on the other ranks, whose model was built on the meta
    device and materialised with ``to_empty``). One tensor at a time is broadcast and every rank keeps
    only its rows, so no rank holds a second copy of the model; rank 0 drops each whole tensor from
    ``full`` once it is sent (the dict is consumed), so its copy shrinks as the shards fill. Parameters and buffers alike: buffers
    that are not in the state dict (rotary ``inv_freq``) come from rank 0 too, so a meta-built rank
    never runs with uninitialised memory. Collective: every rank calls it."""
    from torch.distributed.tensor import DTensor

    named = local_tensors(model)
    if not _same_structure(named):
        raise ValueError(
            "meta-device init: the ranks built different models (names, shapes or dtypes differ); "
            "is the model code deterministic?"
        )
    rank0 = _rank() == 0
    if rank0 and set(full) != set(named):
        raise ValueError(
            f"meta-device init: rank 0's loaded tensors differ from the sharded model's: "
            f"{sorted(set(full) ^ set(named))[:4]}"
        )
    comm = _comm_device()
    # One receive buffer per dtype, as large as the largest tensor, and rows copied from views: no
    # per-tensor temporaries for the allocator to keep around (they raised rank 0's peak by ~1/3 of
    # the model in the memory benchmark).
    size: dict[torch.dtype, int] = {}
    for t in named.values():
        size[t.dtype] = max(size.get(t.dtype, 0), t.numel())
    bufs = {} if rank0 else {d: torch.empty(n, dtype=d, device=comm) for d, n in size.items()}
    for name, t in named.items():
        if rank0:
            src = full.pop(name).detach().to(device=comm, dtype=t.dtype).contiguous()
        else:
            src = bufs[t.dtype][: t.numel()].view(t.shape)
        dist.broadcast(src, src=0)
        if isinstance(t, DTensor):
            _, first, rows = row_range(t)
            t.to_local().copy_(src.narrow(0, first, rows))
        else:
            t.copy_(src)
