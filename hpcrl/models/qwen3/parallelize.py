"""Expert parallelism for the custom Qwen3-MoE, applied from outside the model code.

Layout over a trainer world of W ranks with ``ep = N`` (N divides W and the expert count E):
- ranks form a 2-D mesh (dp_ep = W / N, ep = N); rank r sits in ep group r // N at position r % N;
- each MoE layer's stacked experts become DTensors ``Shard(0)`` over the ``ep`` mesh: the rank at ep
  position i owns experts [i*E/N, (i+1)*E/N) whole (no FSDP on them), replicated across the dp_ep
  groups, whose expert gradients are summed by ``sync_expert_grads`` (a plain all-reduce);
- everything else (attention, router, norms, embeddings, dense MLPs) is FSDP2-sharded over all W
  ranks as without EP (``hpcrl.trainer.parallel.apply_fsdp`` ignores the expert parameters).
Checkpoints record the experts' global rows like any FSDP shard (``trainer.state.row_range``), so they
reshard to any other world size / ep.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hpcrl.config.errors import ConfigError
from hpcrl.models.qwen3.moe import MoE


def is_expert_sharded(t: torch.Tensor) -> bool:
    """A DTensor on the ep mesh (an expert parameter or its gradient under expert parallelism)."""
    mesh = getattr(t, "device_mesh", None)
    return mesh is not None and mesh.mesh_dim_names == ("ep",)


def apply_ep(model: nn.Module, ep: int, device: torch.device) -> set[nn.Parameter]:
    """Shard every MoE layer's experts over groups of ``ep`` ranks; returns the expert parameters
    (FSDP must ignore them). Collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    world = dist.get_world_size() if dist.is_initialized() else 1
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    if not moes:
        raise ConfigError("trainer.model.ep", "the model has no MoE layers; set ep = 1")
    if world % ep:
        raise ConfigError("trainer.model.ep", f"{ep} does not divide the {world} trainer ranks")
    experts = moes[0].num_experts
    if experts % ep:
        raise ConfigError("trainer.model.ep", f"{ep} does not divide the model's {experts} experts")
    mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("dp_ep", "ep"))
    ep_mesh = mesh["ep"]
    pos, n_local = ep_mesh.get_local_rank(), experts // ep
    out: set[nn.Parameter] = set()
    for m in moes:
        m.ep_group, m.ep_size = ep_mesh.get_group(), ep
        m.ep_replica_group = mesh["dp_ep"].get_group() if world > ep else None
        for name, p in list(m.experts.named_parameters(recurse=False)):
            local = p.detach().narrow(0, pos * n_local, n_local).clone()
            new = nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False))
            setattr(m.experts, name, new)
            out.add(new)
    return out


def sync_expert_grads(model: nn.Module) -> None:
    """Sum expert gradients over the dp_ep replicas (no-op when W == ep or without EP)."""
    for m in model.modules():
        group = getattr(m, "ep_replica_group", None) if isinstance(m, MoE) else None
        for p in m.experts.parameters() if group is not None else ():
            if p.grad is not None:
                dist.all_reduce(p.grad.to_local(), group=group)
