"""Muon (prime-rl's ``type = "muon"``): Muon on the hidden matrices, AdamW on every other parameter,
as one optimizer, so the scheduler, the checkpointer and the warm start see one set of param groups
and one state.

Each param group has an ``algorithm``, ``"muon"`` or ``"adamw"`` (prime-rl builds dion's Muon the same
way; :func:`hpcrl.trainer.optim.muon_param_groups` does the split). The Muon update is
``torch.optim.Muon``'s, with its Newton-Schulz iteration, constants and learning-rate adjustment:

    B <- mu * B + (1 - mu) * G                       momentum buffer (per element)
    U <- (1 - mu) * G + mu * B  if nesterov else B
    O <- NS5(U)                                      ~ the orthogonal polar factor of U (U V^T of its SVD)
    W <- W * (1 - lr * weight_decay) - lr * 0.2 * sqrt(max(rows, cols)) * O

The last factor is torch's ``adjust_lr_fn = "match_rms_adamw"`` (dion's ``adjust_lr = "rms_norm"``, what
prime-rl uses): it gives the update AdamW's RMS, so Muon reuses AdamW's learning rate. prime-rl's
momentum is ``B <- mu * B + G`` (not averaged): the same direction, and NS5 divides by the norm first,
so O is the same. The AdamW groups are ``torch.optim.AdamW``'s step itself.

Under FSDP2 every parameter is a DTensor split by rows (``torch.chunk`` over the ranks). The momentum
is per element, so it stays sharded (and so does its checkpoint); NS5 needs the whole matrix, so each
rank all-gathers the update U of a matrix, orthogonalizes it (every rank the same bits, on the same
input), and applies its own rows. A 3-D parameter (the MoE experts, [experts, rows, cols]) is a stack
of matrices: sharding splits only its first dimension, so every rank holds whole matrices and
orthogonalizes its own, with no communication (dion does the same). Every rank orthogonalizes every
2-D matrix (dion spreads them over the ranks): simpler, and the same result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer
from torch.optim._muon import (  # torch.optim.Muon's own pieces (torch >= 2.9)
    DEFAULT_A,
    DEFAULT_B,
    DEFAULT_C,
    DEFAULT_NS_STEPS,
    EPS,
    _adjust_lr,
    _zeropower_via_newtonschulz,
)

from hpcrl.models.parallelize import row_range
from hpcrl.trainer.sign_sgd import closure_loss, local

MUON, ADAMW = "muon", "adamw"
ADJUST_LR = "match_rms_adamw"  # dion's "rms_norm", prime-rl's choice


class Muon(Optimizer):
    """``groups``: dicts with ``params`` and ``algorithm`` (``"muon"`` or ``"adamw"``), optionally their
    own ``weight_decay``. ``mu``, ``nesterov`` are Muon's; ``betas``, ``eps`` the AdamW groups'."""

    def __init__(
        self,
        groups: list[dict[str, Any]],
        *,
        lr: float,
        weight_decay: float = 0.0,
        mu: float = 0.95,
        nesterov: bool = False,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ) -> None:
        if lr < 0:
            raise ValueError(f"optim.lr: {lr} must be >= 0")
        if not 0 <= mu < 1:
            raise ValueError(f"optim.mu: {mu} must be in [0, 1)")
        unknown = {g.get("algorithm") for g in groups} - {MUON, ADAMW}
        if unknown:
            raise ValueError(f"param group algorithm {sorted(map(str, unknown))} is not 'muon' or 'adamw'")
        muon = [g for g in groups if g["algorithm"] == MUON]
        for g in muon:
            for p in g["params"]:
                if p.ndim not in (2, 3):
                    raise ValueError(f"Muon updates matrices (or stacks of them), not shape {list(p.shape)}")
        others = [g for g in groups if g["algorithm"] == ADAMW]
        # AdamW fills its defaults into these very dicts, which become this optimizer's groups too.
        self._adamw = (
            torch.optim.AdamW(others, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
            if others
            else None
        )
        ns = {
            "momentum": mu,
            "nesterov": nesterov,
            "ns_coefficients": (DEFAULT_A, DEFAULT_B, DEFAULT_C),
            "ns_steps": DEFAULT_NS_STEPS,
            "eps": EPS,
            "adjust_lr_fn": ADJUST_LR,
        }
        own = [{**ns, **g} for g in muon]
        super().__init__(
            own + (self._adamw.param_groups if self._adamw else []), {"lr": lr, "weight_decay": weight_decay}
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure_loss(closure)
        for group in self.param_groups:
            if group["algorithm"] == MUON:
                for p in group["params"]:
                    if p.grad is not None:
                        self._update(p, group)
        if self._adamw is not None:
            # the groups and state are this optimizer's (a checkpoint load may have replaced them)
            self._adamw.param_groups = [g for g in self.param_groups if g["algorithm"] == ADAMW]
            self._adamw.state = self.state
            self._adamw.step()
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[p]
        if "momentum_buffer" not in state:  # sharded like the parameter (a DTensor under FSDP)
            state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
        grad, buf, mu = local(p.grad), local(state["momentum_buffer"]), group["momentum"]
        buf.lerp_(grad, 1 - mu)
        update = grad.lerp(buf, mu) if group["nesterov"] else buf
        ortho = orthogonalized_rows(update, p, group)
        lr = group["lr"]
        x = local(p)
        x.mul_(1 - lr * group["weight_decay"])
        x.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape[-2:]))


def orthogonalized_rows(update: torch.Tensor, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """NS5 of the whole matrix whose rows this rank holds in ``update`` (rows of ``p``'s layout), cut
    back to those rows; a 3-D stack: NS5 of each of its (whole) matrices."""

    def ns(m: torch.Tensor) -> torch.Tensor:
        coefficients = tuple(group["ns_coefficients"])  # a list after a JSON checkpoint round trip
        return _zeropower_via_newtonschulz(m, coefficients, group["ns_steps"], group["eps"])

    if update.ndim == 3:
        return torch.stack([ns(m) for m in update]) if update.shape[0] else update.bfloat16()
    _, first, count = row_range(p)
    return ns(gather_rows(update, p))[first : first + count]


def gather_rows(rows: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which ``rows`` are this rank's part, laid out like ``p`` (collective when
    ``p`` is a DTensor: every rank of its mesh calls it for the same parameter)."""
    if not hasattr(p, "device_mesh"):
        return rows
    from torch.distributed.tensor import DTensor

    shard = DTensor.from_local(
        rows, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
    )
    return shard.full_tensor()
