"""Sign SGD (prime-rl's ``type = "sign_sgd"``): every element moves by exactly ``lr`` against the sign of
its gradient, after decoupled weight decay,

    p <- p * (1 - lr * weight_decay) - lr * sign(grad)

which is AdamW with beta1 = beta2 = 0 and no epsilon (m = g, v = g^2, g / sqrt(g^2) = sign(g)). It
keeps no state, so it costs no optimizer memory and its checkpoint holds only the param groups.

Elementwise, so FSDP needs nothing special: each rank updates the rows it holds, and the gradient it
sees is already the reduce-scattered gradient of the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer


def local(t: torch.Tensor) -> torch.Tensor:
    """The rows this rank holds (a DTensor's local shard; a plain tensor is all of itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def closure_loss(closure: Callable[[], Any] | None) -> Any:
    """torch's optimizer protocol: ``step(closure)`` re-evaluates the loss, with gradients on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class SignSGD(Optimizer):
    def __init__(self, params: Iterable[Any], lr: float = 1e-3, weight_decay: float = 0.0) -> None:
        if lr < 0:
            raise ValueError(f"optim.lr: {lr} must be >= 0")
        if weight_decay < 0:
            raise ValueError(f"optim.weight_decay: {weight_decay} must be >= 0")
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure_loss(closure)
        for group in self.param_groups:
            lr, decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                x = local(p)
                if decay:
                    x.mul_(1 - lr * decay)
                x.add_(local(p.grad).sign(), alpha=-lr)
        return loss
