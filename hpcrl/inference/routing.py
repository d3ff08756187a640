"""Which experts an MoE model routed each token to, recorded during generation (router replay).

Forward hooks on the model's router modules (transformers' ``Qwen3MoeTopKRouter`` returns
``(logits, scores, indices)``; any module named ``*.mlp.gate`` whose output holds the top-k indices
works) keep the top-k expert ids of the last forward, one [rows, k] tensor per MoE layer. After a
decode step the engine takes them: row i is the routing of the token row i was fed, i.e. of the
sequence's newest sampled token. A sequence's routing is thus known for every sampled token but the
last (never fed back); that one is reported as -1, and the trainer routes it freely.
"""

from __future__ import annotations

from typing import Any

import torch


def _indices(output: Any) -> torch.Tensor | None:
    if isinstance(output, tuple) and len(output) >= 3 and isinstance(output[2], torch.Tensor):
        return output[2]  # transformers' TopKRouter: (logits, scores, indices)
    return None


class RoutingRecorder:
    def __init__(self, model: torch.nn.Module):
        self.layers: list[str] = []
        self._last: dict[int, torch.Tensor] = {}
        for name, mod in model.named_modules():
            if name.endswith(".mlp.gate") and type(mod).__name__.endswith("Router"):
                i = len(self.layers)
                self.layers.append(name)
                mod.register_forward_hook(self._hook(i))

    @property
    def enabled(self) -> bool:
        return bool(self.layers)

    def _hook(self, i: int):
        def hook(_mod: Any, _inp: Any, output: Any) -> None:
            idx = _indices(output)
            if idx is not None:
                self._last[i] = idx.detach()

        return hook

    def take(self, rows: int) -> torch.Tensor | None:
        """int16 [rows, layers, k] of the last forward (None without MoE layers)."""
        if not self.layers or len(self._last) != len(self.layers):
            return None
        out = torch.stack([self._last[i].reshape(rows, -1) for i in range(len(self.layers))], dim=1)
        self._last.clear()
        return out.to(torch.int16).cpu()


def finish(routed: list[torch.Tensor], n_tokens: int) -> list[list[list[int]]] | None:
    """Per completion token [layers][k] expert ids (-1 rows where unknown: the last token)."""
    if not routed:
        return None
    layers, k = routed[0].shape
    rows = routed[:n_tokens]
    pad = [torch.full((layers, k), -1, dtype=torch.int16)] * (n_tokens - len(rows))
    return torch.stack(rows + pad).tolist() if rows or pad else []
