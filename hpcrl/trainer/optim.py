"""Optimizer (adamw, sgd, muon, sign_sgd: prime-rl's four), learning-rate schedule and gradient
clipping.

Schedules are ``LambdaLR`` over a pure function of the step, so their ``state_dict`` is just the
step counter and a resumed run continues on exactly the same curve.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

if TYPE_CHECKING:
    from hpcrl.config.sections.trainer import OptimConfig

OptimizerName = Literal["adamw", "sgd", "muon", "sign_sgd"]
ScheduleName = Literal["constant", "linear", "cosine"]
NAMES = ("adamw", "sgd", "muon", "sign_sgd")
log = logging.getLogger("hpcrl.trainer")


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases and norm gains (1-D) are not regularised towards 0. Frozen
    parameters (LoRA base weights) are left out of the optimizer altogether."""
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def muon_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """prime-rl's split for Muon: the trainable matrices (2-D, and the MoE experts' 3-D stacks, router
    included) go to Muon, except the input embedding and the LM head (a lookup table and a classifier,
    not hidden maps); those and the 1-D parameters go to AdamW. As in :func:`param_groups`, 1-D
    parameters are not decayed. Empty groups are left out."""
    from hpcrl.models.embeddings import embeddings

    vocab = {id(m.weight) for m in embeddings(model) if m is not None and hasattr(m, "weight")}
    matrices, tables, vectors = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2:
            vectors.append(p)
        elif id(p) in vocab or "embed_tokens" in name or "lm_head" in name:
            tables.append(p)
        else:
            matrices.append(p)
    groups = [
        {"params": matrices, "algorithm": "muon", "weight_decay": weight_decay},
        {"params": tables, "algorithm": "adamw", "weight_decay": weight_decay},
        {"params": vectors, "algorithm": "adamw", "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    model: nn.Module,
    name: OptimizerName = "adamw",
    *,
    lr: float = 1e-6,
    weight_decay: float = 0.01,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    momentum: float = 0.0,
    nesterov: bool = False,
    mu: float = 0.95,
) -> Optimizer:
    """The optimizer over the trainable parameters (build it AFTER sharding: FSDP swaps parameters).
    adamw: betas, eps; sgd: momentum, nesterov; muon (:class:`hpcrl.trainer.muon.Muon`): mu, and
    betas, eps for its AdamW groups; sign_sgd (:class:`hpcrl.trainer.sign_sgd.SignSGD`): lr and
    weight decay only."""
    if lr < 0:
        raise ValueError(f"optim.lr: {lr} must be >= 0")
    if weight_decay < 0:
        raise ValueError(f"optim.weight_decay: {weight_decay} must be >= 0")
    if name not in NAMES:
        raise ValueError(f"optim.name: {name!r} is not one of {list(NAMES)}")
    if name in ("adamw", "muon") and not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"optim.betas: {betas} must both be in [0, 1)")
    groups = muon_param_groups(model, weight_decay) if name == "muon" else param_groups(model, weight_decay)
    if not any(g["params"] for g in groups):
        raise ValueError("the model has no trainable parameters")
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)
    if name == "sgd":
        if nesterov and momentum <= 0:
            raise ValueError("optim.nesterov needs optim.momentum > 0")
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov)
    if name == "muon":
        from hpcrl.trainer.muon import Muon

        return Muon(groups, lr=lr, weight_decay=weight_decay, mu=mu, betas=betas, eps=eps)
    from hpcrl.trainer.sign_sgd import SignSGD

    return SignSGD(groups, lr=lr)


def optimizer_from_config(model: nn.Module, cfg: OptimConfig) -> Optimizer:
    """:func:`build_optimizer` with the config's type and settings (unset ones: the type's defaults)."""
    s = cfg.settings()
    extra: dict[str, Any] = {}
    if "betas1" in s:
        extra["betas"] = (s["betas1"], s["betas2"])
    if "eps" in s:
        extra["eps"] = s["eps"]
    for key in ("momentum", "nesterov", "mu"):
        if key in s:
            extra[key] = s[key]
    opt = build_optimizer(model, cfg.type, lr=cfg.lr, weight_decay=cfg.weight_decay, **extra)
    log.info("optimizer: %s", describe(opt, cfg.type))
    return opt


def describe(optimizer: Optimizer, name: str) -> str:
    """``muon (Muon: 14 tensors, AdamW: 17 tensors)``, ``adamw (31 tensors)``: what updates how many
    parameter tensors."""
    counts: dict[str, int] = {}
    for g in optimizer.param_groups:
        algorithm = {"muon": "Muon: ", "adamw": "AdamW: "}.get(g.get("algorithm", ""), "")
        counts[algorithm] = counts.get(algorithm, 0) + len(g["params"])
    return f"{name} (" + ", ".join(f"{k}{n} tensors" for k, n in counts.items()) + ")"


def lr_lambda(
    step: int, *, schedule: ScheduleName, warmup_steps: int, total_steps: int | None, min_lr_ratio: float
) -> float:
    """Multiplier of the base LR at optimizer step ``step`` (0-based): linear warmup from ~0 over
    ``warmup_steps``, then constant, linear or cosine decay to ``min_lr_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    assert total_steps is not None, "decaying schedules need total_steps"
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    if schedule == "linear":
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: Optimizer,
    schedule: ScheduleName = "constant",
    *,
    warmup_steps: int = 0,
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"optim.scheduler: {schedule!r} is not one of ['constant', 'linear', 'cosine']")
    if warmup_steps < 0:
        raise ValueError(f"optim.warmup_steps: {warmup_steps} must be >= 0")
    if schedule != "constant" and (total_steps is None or total_steps <= warmup_steps):
        raise ValueError(f"optim.scheduler {schedule!r} needs total_steps > warmup_steps ({warmup_steps})")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"optim.min_lr_ratio: {min_lr_ratio} must be in [0, 1]")

    def fn(step: int) -> float:
        return lr_lambda(
            step,
            schedule=schedule,
            warmup_steps=warmup_steps,
            total_steps=total_steps,
            min_lr_ratio=min_lr_ratio,
        )

    return LambdaLR(optimizer, fn)


def load_scheduler_state(scheduler: LambdaLR, state: dict) -> None:
    """Restore a scheduler AND re-apply its learning rate to the optimizer: ``load_state_dict`` alone
    only restores the step counter, so without this the first resumed step would use a stale LR."""
    # LambdaLR.load_state_dict requires the key; the lambdas themselves are rebuilt from the config.
    state = {**state, "lr_lambdas": state.get("lr_lambdas") or [None] * len(scheduler.lr_lambdas)}
    scheduler.load_state_dict(state)
    step = scheduler.last_epoch
    for group, base, fn in zip(
        scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base * fn(step)
    scheduler._last_lr = [g["lr"] for g in scheduler.optimizer.param_groups]


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float | None) -> float:
    """Global L2 norm of the gradients (over all ranks under FSDP), clipped to ``max_norm`` when set.

    Returns the norm before clipping; NaN/inf means the step must be skipped (the loop decides)."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    from hpcrl.models.parallelize import is_expert_sharded

    if any(is_expert_sharded(p) for p in params):
        return _clip_mixed_meshes(params, max_norm)
    if max_norm is not None and max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False)
    else:
        grads = [p.grad for p in params]
        norm = torch.nn.utils.get_total_norm(grads, foreach=False)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


def current_lr(optimizer: Optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def _clip_mixed_meshes(params: list[torch.Tensor], max_norm: float | None) -> float:
    """The global norm when gradients live on different meshes (expert parallelism: experts sharded
    over the ep mesh, the rest FSDP over all ranks), which torch's clip cannot stack: every rank sums
    its local squares, each divided by how many ranks hold the same values, and one all-reduce adds."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        g = p.grad
        local = g.to_local() if hasattr(g, "to_local") else g
        holders = world // g.device_mesh.size() if hasattr(g, "device_mesh") else world
        total += local.detach().double().pow(2).sum().cpu() / holders
    if world > 1:  # gloo or nccl: the sum travels on the backend's device
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        total = total.to(dev)
        dist.all_reduce(total)
    norm = float(total.sqrt())
    if max_norm is not None and max_norm > 0 and norm == norm:
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            for p in params:
                (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).mul_(coef)
    return norm
