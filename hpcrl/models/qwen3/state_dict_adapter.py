"""Hugging Face names <-> the custom model's names. Only the experts differ: HF checkpoints (and
what vLLM / transformers load) hold one tensor per expert, ``...mlp.experts.{e}.{gate,up,down}_proj.weight``;
the custom model stacks them, ``...mlp.experts.{gate,up,down}_proj`` [E, ...]. transformers 5's own
in-memory layout (``experts.gate_up_proj`` [E, 2I, H]) is read too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_proj|up_proj|down_proj)$")
_FUSED = re.compile(r"^(.*\.mlp\.experts)\.gate_up_proj$")


def to_hf(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Custom names -> HF checkpoint names (stacked experts split into per-expert tensors)."""
    for name, t in named:
        m = _STACKED.match(name)
        if m is None:
            yield name, t
            continue
        for e in range(t.shape[0]):
            yield f"{m.group(1)}.{e}.{m.group(2)}.weight", t[e]


def from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names (per-expert or transformers-5 fused) -> custom names (stacked experts)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        m = _PER_EXPERT.match(name)
        f = _FUSED.match(name)
        if m is not None:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = t
        elif f is not None:
            gate, up = t.chunk(2, dim=1)
            out[f"{f.group(1)}.gate_proj"] = gate.contiguous()
            out[f"{f.group(1)}.up_proj"] = up.contiguous()
        else:
            out[name] = t
    for (prefix, proj), per in experts.items():
        n = max(per) + 1
        if sorted(per) != list(range(n)):
            raise ValueError(f"checkpoint has experts {sorted(per)} for {prefix}.*.{proj}: not 0..{n - 1}")
        out[f"{prefix}.{proj}"] = torch.stack([per[e] for e in range(n)])
    return out


def is_stacked_expert(name: str) -> bool:
    return _STACKED.match(name) is not None


def hf_views(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers-5 model's state dict with its fused experts replaced by per-expert *views* under
    the checkpoint names (``experts.{e}.gate_proj.weight`` ...): a server writing a published update
    (per-expert names) into these views writes the fused parameters in place."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        f = _FUSED.match(name)
        s = _STACKED.match(name)
        if f is not None:
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{f.group(1)}.{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{f.group(1)}.{e}.up_proj.weight"] = t[e, inter:]
        elif s is not None and t.dim() == 3:
            for e in range(t.shape[0]):
                out[f"{s.group(1)}.{e}.{s.group(2)}.weight"] = t[e]
        else:
            out[name] = t
    return out
