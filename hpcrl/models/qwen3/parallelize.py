"""Expert parallelism for the custom Qwen3-MoE, applied from outside the model code.

Layout over a trainer world of W ranks with ``ep = N`` (N divides W and the expert count E):
- ranks form a 2-D mesh (dp_ep = W / N, ep = N); rank r sits in ep group r // N at position r % N;
- each MoE layer's stacked experts become DTensors ``Shard(0)`` over the ``ep`` mesh: the rank at ep
  position i computes with experts [i*E/N, (i+1)*E/N);
- with dp_ep > 1 those experts are FSDP2-sharded over the dp_ep ranks that share position i (the
  ``GroupedExperts`` module is its own FSDP unit on the dp_ep mesh: gathered for its forward and
  backward, gradients reduce-scattered), so every rank stores E / W experts' parameters, gradients
  and optimizer state, as FSDP stores the rest; with dp_ep = 1 they are stored whole (E / N = E / W)
  and FSDP leaves them alone;
- everything else (attention, router, norms, embeddings, dense MLPs) is FSDP2-sharded over all W
  ranks as without EP (``hpcrl.models.parallelize.apply_fsdp``).
Checkpoints record the experts' global rows like any FSDP shard (``models.parallelize.row_range``: each
rank's rows are one contiguous run), so they reshard to any other world size / ep.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hpcrl.models.qwen3.moe import MoE
from hpcrl.models.rules import check_ep


def apply_ep(
    model: nn.Module,
    ep: int,
    device: torch.device,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
) -> set[nn.Parameter]:
    """Shard every MoE layer's experts over groups of ``ep`` ranks, and with dp_ep > 1 FSDP-shard
    each position's experts over its dp_ep ranks (mixed precision as ``apply_fsdp``'s); returns the
    expert parameters the outer FSDP must ignore (none when they are FSDP units of their own).
    Collective: every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    world = dist.get_world_size() if dist.is_initialized() else 1
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    experts = moes[0].num_experts if moes else None
    check_ep(ep, world, num_experts=experts, moe=bool(moes))
    mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("dp_ep", "ep"))
    ep_mesh = mesh["ep"]
    pos, n_local = ep_mesh.get_local_rank(), experts // ep
    out: set[nn.Parameter] = set()
    for m in moes:
        m.ep_group, m.ep_size = ep_mesh.get_group(), ep
        for name, p in list(m.experts.named_parameters(recurse=False)):
            local = p.detach().narrow(0, pos * n_local, n_local).clone()
            dt = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)
            new = nn.Parameter(dt, requires_grad=p.requires_grad)  # frozen under LoRA stays frozen
            setattr(m.experts, name, new)
            out.add(new)
    if world == ep:
        return out
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for m in moes:  # apply_fsdp sets every FSDP unit's SUM reduction, these included
        fully_shard(m.experts, mesh=mesh["dp_ep"], mp_policy=mp, reshard_after_forward=True)
    return set()
