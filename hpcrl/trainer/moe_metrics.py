"""MoE metrics and the optional load-balancing loss, read from the custom model's routers.

Per MoE layer j (seed 001's names):
- ``moe/max_vio/layer_j``: (max expert load - mean load) / mean load over the step's routed slots
  (0 = perfectly balanced; E-1 = every token on one expert);
- ``moe/routing_confidence/layer_j``: mean top-k probability mass the router put on the experts used;
- ``moe/load_max/layer_j`` / ``moe/load_min/layer_j``: the busiest / idlest expert's share of slots;
and over all layers their means, ``moe/replay_hit_rate`` (share of replayed (token, slot) pairs whose
expert the trainer's own router also had in its top-k: 1 = no routing mismatch) and
``moe/a2a_bytes`` (expert-parallel dispatch + combine bytes sent to other ranks this step).
Counts are summed over ranks (one all-reduce), so every rank logs the same values.
"""

from __future__ import annotations

import torch


def moe_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's MoE layers that keep routing statistics (a family's MoE module says so with the
    class attribute ``hpcrl_moe``, as hpcrl.models.qwen3.moe.MoE does)."""
    return [m for m in model.modules() if getattr(m, "hpcrl_moe", False)]


def set_aux_coef(model: torch.nn.Module, coef: float) -> None:
    for m in moe_layers(model):
        m.aux_coef = coef


def take_aux_loss(model: torch.nn.Module) -> torch.Tensor | None:
    """coef x the mean over layers of the Switch-style balance loss E * sum_e f_e * P_e of the last
    forward (with grad), or None when the coefficient is 0 / no MoE layer."""
    terms, coef = [], 0.0
    for m in moe_layers(model):
        terms += m.stats.aux
        m.stats.aux = []
        coef = m.aux_coef
    if not terms or coef <= 0:
        return None
    return coef * torch.stack(terms).mean()


def max_vio(load: torch.Tensor) -> float:
    mean = load.float().mean()
    return float((load.float().max() - mean) / mean) if mean > 0 else 0.0


def collect(model: torch.nn.Module) -> dict[str, float]:
    """The step's MoE metrics (collective under several ranks: every rank calls it); resets the stats."""
    from hpcrl.trainer.parallel import all_reduce_sum

    layers = moe_layers(model)
    if not layers:
        return {}
    e = layers[0].num_experts
    rows = []
    for m in layers:
        s = m.stats
        load = s.load if s.load is not None else torch.zeros(e, dtype=torch.long)
        rows.append(torch.cat([load.double(), torch.tensor([s.confidence, s.tokens], dtype=torch.float64)]))
    extra = torch.tensor(
        [sum(m.stats.replay_slots for m in layers), sum(m.stats.replay_hits for m in layers),
         sum(m.stats.a2a_bytes for m in layers)], dtype=torch.float64,
    )  # fmt: skip
    flat = all_reduce_sum(torch.cat([torch.stack(rows).reshape(-1), extra]))
    for m in layers:
        m.stats = type(m.stats)()
    table = flat[: len(layers) * (e + 2)].view(len(layers), e + 2)
    out: dict[str, float] = {}
    vios, confs = [], []
    for j, row in enumerate(table):
        load, conf, tokens = row[:e], float(row[e]), float(row[e + 1])
        slots = float(load.sum())
        vios.append(max_vio(load))
        confs.append(conf / tokens if tokens else 0.0)
        out[f"moe/max_vio/layer_{j}"] = vios[-1]
        out[f"moe/routing_confidence/layer_{j}"] = confs[-1]
        out[f"moe/load_max/layer_{j}"] = float(load.max()) / slots if slots else 0.0
        out[f"moe/load_min/layer_{j}"] = float(load.min()) / slots if slots else 0.0
    out["moe/max_vio/mean"] = sum(vios) / len(vios)
    out["moe/routing_confidence/mean"] = sum(confs) / len(confs)
    replay_slots, hits, a2a = (float(x) for x in flat[-3:])
    if replay_slots:
        out["moe/replay_hit_rate"] = hits / replay_slots
    out["moe/a2a_bytes"] = a2a
    return out
