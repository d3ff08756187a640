"""Qwen3-MoE feed-forward: a top-k softmax router and experts in stacked parameters.

Experts of a layer live in three stacked tensors (HF ``nn.Linear`` layout per expert):
``gate_proj``/``up_proj`` [E, I, H] and ``down_proj`` [E, H, I]. Tokens are sorted by expert and run
as one grouped matmul (``torch._grouped_mm`` on CUDA; on CPU a loop over the groups, whose
``_grouped_mm`` fallback has no working backward in torch 2.13).

Expert parallelism (``parallelize.apply_ep``): each rank of an ep group owns ``E / ep`` consecutive
experts; the routed copies of this rank's tokens travel to their expert's owner and back with two
uneven ``all_to_all_single`` calls (autograd-aware, so expert gradients land on their owner). The
experts compute inside ``GroupedExperts.forward``: FSDP (which shards them over the ranks that
share an ep position) gathers them around that call and again for its backward.

Router replay: ``replay`` ([N, k] expert ids, -1 = not replayed) overrides the router's top-k for
those tokens; the gate weights are still the trainer's own softmax at those experts, so the router
keeps learning. It is an argument of ``forward``, not state on the module: an activation-checkpoint
recompute then replays the same routes (torch.utils.checkpoint keeps the layer's arguments).
Statistics for the MoE metrics are accumulated on the module (``stats``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class RoutingStats:
    """Summed over the forwards of one step (reset by ``hpcrl.trainer.moe_metrics``)."""

    load: Tensor | None = None  # [E] routed token slots per expert
    confidence: float = 0.0  # sum over tokens of the top-k probability mass
    tokens: int = 0
    replay_slots: int = 0  # replayed (token, slot) pairs
    replay_hits: int = 0  # of which the router's own top-k holds the replayed expert
    a2a_bytes: int = 0  # bytes this rank sent to other ranks (dispatch + combine)
    aux: list[Tensor] = field(default_factory=list)  # load-balancing loss terms (with grad)


def _in_backward() -> bool:
    """Inside an activation-checkpoint recompute: statistics were counted by the first forward."""
    return torch._C._current_graph_task_id() != -1


def grouped_ffn(x: Tensor, counts: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """SwiGLU of rows grouped by expert as three ``torch._grouped_mm`` calls (CUDA, bf16)."""
    offs = torch.cumsum(counts, 0).to(torch.int32)
    g = torch._grouped_mm(x, gate.transpose(-2, -1), offs=offs)
    u = torch._grouped_mm(x, up.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(F.silu(g) * u, down.transpose(-2, -1), offs=offs)


def loop_ffn(x: Tensor, counts: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """The same as a loop over the groups (CPU, other dtypes; the reference in scripts/bench/gpu.py).

    Empty groups run too: under expert parallelism the output must stay connected to ``x`` even
    when no row arrived, or this rank would skip the dispatch's backward all-to-all and hang the others."""
    outs = [
        F.linear(F.silu(F.linear(part, gate[e])) * F.linear(part, up[e]), down[e])
        for e, part in enumerate(torch.split(x, counts.tolist()))
    ]
    return torch.cat(outs)


def expert_ffn(x: Tensor, counts: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """SwiGLU of rows ``x`` [M, H] grouped by expert (``counts`` [E] rows each, in order)."""
    if x.is_cuda and hasattr(torch, "_grouped_mm") and x.dtype == torch.bfloat16:
        return grouped_ffn(x, counts, gate, up, down)
    return loop_ffn(x, counts, gate, up, down)


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class GroupedExperts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_proj = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    def local_weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """This rank's experts (a DTensor sharded by apply_ep gives its rows), in the compute dtype."""

        def loc(p: Tensor) -> Tensor:
            t = p.to_local() if hasattr(p, "to_local") else p
            return t.to(dtype)

        return loc(self.gate_proj), loc(self.up_proj), loc(self.down_proj)

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        """SwiGLU of rows ``x`` grouped by (this rank's) expert, ``counts`` rows each."""
        return expert_ffn(x, counts, *self.local_weights(x.dtype))


class MoE(nn.Module):
    hpcrl_moe = True  # routing statistics and the aux loss: what hpcrl.trainer.moe_metrics reads

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.gate = Router(hidden, num_experts)
        self.experts = GroupedExperts(num_experts, hidden, inter)
        self.ep_group = None  # set by parallelize.apply_ep
        self.ep_size = 1
        self.stats = RoutingStats()
        self.aux_coef = 0.0  # > 0: keep a load-balancing loss term per forward

    def route(self, x: Tensor, replay: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(expert ids [N, k], gate weights [N, k]) for tokens ``x`` [N, H]; ``replay`` [N, k] long
        (-1 = route freely) forces experts."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        idx = top_i
        if replay is not None:
            rep = replay.to(x.device)
            assert rep.shape == top_i.shape, (rep.shape, top_i.shape)
            use = rep >= 0
            idx = torch.where(use, rep, top_i)
            top_w = probs.gather(1, idx)
            if not _in_backward():
                hit = (rep.unsqueeze(-1) == top_i.unsqueeze(1)).any(-1) & use
                self.stats.replay_slots += int(use.sum())
                self.stats.replay_hits += int(hit.sum())
        # An activation-checkpoint recompute must save exactly the tensors the forward saved: the
        # statistics run without autograd, and the aux term (which needs it) is built in both passes.
        recompute = _in_backward()
        if not recompute:
            with torch.no_grad():
                load = torch.bincount(idx.reshape(-1), minlength=self.num_experts).cpu()
                self.stats.load = load if self.stats.load is None else self.stats.load + load
                self.stats.confidence += float(probs.gather(1, idx).sum())
                self.stats.tokens += x.shape[0]
        if self.aux_coef > 0 and x.shape[0]:
            counts = torch.bincount(idx.reshape(-1), minlength=self.num_experts)
            frac = counts.to(torch.float32) / max(1, idx.numel())
            aux = self.num_experts * (frac * probs.mean(0)).sum()
            if not recompute:
                self.stats.aux.append(aux)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return idx, top_w.to(x.dtype)

    def forward(self, x: Tensor, replay: Tensor | None = None) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        idx, w = self.route(x, replay)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts)
        xs = x[token]
        ys = self._ep_ffn(xs, counts) if self.ep_size > 1 else self.experts(xs, counts)
        ys = ys * w.reshape(-1)[order].unsqueeze(-1)
        # Back to (token, slot) order and one sum over the k slots, as transformers combines: the sum
        # accumulates in fp32 and rounds once (an index_add_ into a bf16 buffer rounded after every
        # expert, so with top-8 no bf16 output equalled the inference engine's; on CUDA its atomics
        # also made the order, hence the bits, vary from run to run).
        ys = ys.new_empty(ys.shape).index_copy(0, order, ys)
        return ys.view(-1, self.top_k, shape[-1]).sum(1).reshape(shape)

    def _ep_ffn(self, xs: Tensor, counts: Tensor) -> Tensor:
        """Dispatch rows sorted by global expert to the experts' owners, run them, bring them back."""
        from torch.distributed import all_to_all_single as a2a_counts
        from torch.distributed.nn.functional import all_to_all_single

        ep, n_local = self.ep_size, self.num_experts // self.ep_size
        recv_counts = torch.empty_like(counts)
        a2a_counts(recv_counts, counts, group=self.ep_group)  # [ep * n_local]: src-major
        recv = recv_counts.view(ep, n_local)
        send_splits = counts.view(ep, n_local).sum(1).tolist()
        recv_splits = recv.sum(1).tolist()
        x_recv = xs.new_empty(sum(recv_splits), xs.shape[1])
        x_recv = all_to_all_single(x_recv, xs, recv_splits, send_splits, group=self.ep_group)
        # rows arrive grouped by (source rank, local expert): regroup by local expert
        expert_of = torch.repeat_interleave(torch.arange(n_local).repeat(ep), recv.reshape(-1).cpu())
        perm = torch.argsort(expert_of, stable=True).to(xs.device)
        y_local = self.experts(x_recv[perm], recv.sum(0))
        y_recv = torch.empty_like(y_local).index_copy(0, perm, y_local)
        ys = xs.new_empty(xs.shape[0], y_local.shape[1])
        ys = all_to_all_single(ys, y_recv, send_splits, recv_splits, group=self.ep_group)
        if not _in_backward():
            from torch.distributed import get_rank

            me = get_rank(self.ep_group)
            sent = sum(s for r, s in enumerate(send_splits) if r != me)
            back = sum(s for r, s in enumerate(recv_splits) if r != me)
            self.stats.a2a_bytes += (sent + back) * xs.shape[1] * xs.element_size()
        return ys
