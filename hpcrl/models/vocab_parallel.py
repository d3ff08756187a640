"""A vocabulary-parallel LM head and input embedding over each cp group (``trainer.model.vocab_parallel``).

Under context parallelism every rank of a cp group holds a slice of the same sequences, and FSDP
gathered the whole ``[V, H]`` embedding / LM-head weight on every rank, and built its whole fp32
gradient there, for a forward over ``T / cp`` tokens: at Qwen3's vocabulary the weight and its
gradient outweigh the attention and MLP activations of small-hidden models, and they do not shrink
with cp. Here the weight never exists whole. It stays the DTensor FSDP would make (``Shard(0)`` over
all trainer ranks: checkpoints, export and weight sync read it unchanged) but FSDP leaves it alone;
rank ``(g, r)`` (cp group ``g``, rank ``r`` in it) gathers only the rows of its dp peers
``{g' * cp + r}``, ``V / cp`` rows, and a cp group's ranks between them hold every row once
(Megatron's vocabulary-parallel layers, with the cp group as the tensor-parallel group):

* **embedding**: the group's token ids are all-gathered, each rank looks up those it holds (zeros
  elsewhere) and a reduce-scatter gives every rank its own tokens' rows;
* **LM head + log-softmax**: the group's kept hidden states (``[cp * K, H]``, small beside the weight)
  are all-gathered, each rank computes its vocabulary columns' logits chunk by chunk (as
  :mod:`hpcrl.models.chunked`) and the per-rank log-sum-exps, expected logits and picked logits are
  combined by one all-gather of three numbers per row; the backward needs no collective but one
  sum of the incoming gradients and a reduce-scatter of the hidden states' gradient.

Each rank's weight gradient is its rows' whole gradient over the group's tokens, reduced over dp
peers (SUM, as FSDP's): the same update as cp = 1 gives, to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from hpcrl.models.chunked import _chunk_logits, _exp_rows
from hpcrl.models.embeddings import embeddings

PAD_LOGIT = -1e30  # a padding row's logit: exp() is 0 and 0 * logit is 0 (an -inf would make NaN)


# torch 2.13 renamed the tensor collectives (the old names warn); older releases have only those.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather(x: Tensor, group: Any, size: int) -> Tensor:
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    _ALL_GATHER(out, x.contiguous(), group=group)
    return out


def _scatter_sum(x: Tensor, group: Any, size: int) -> Tensor:
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    _REDUCE_SCATTER(out, x.contiguous(), group=group)
    return out


class _Exchange(torch.autograd.Function):
    """``gather``: every rank's rows of ``group`` in rank order (cast to ``dtype`` first, when given),
    whose backward sums the gradient back to the owners (a reduce-scatter, in ``x``'s own dtype: FSDP's
    fp32 reduce under bf16 compute); else the reduce-scatter, whose backward all-gathers."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, x: Tensor, group: Any, size: int, gather: bool, dtype: torch.dtype | None = None
    ) -> Tensor:
        ctx.group, ctx.size, ctx.gather, ctx.dtype = group, size, gather, x.dtype
        if dtype is not None:
            x = x.to(dtype)
        return (_gather if gather else _scatter_sum)(x, group, size)

    @staticmethod
    def backward(ctx, g: Tensor):  # type: ignore[override]
        out = (_scatter_sum if ctx.gather else _gather)(g.to(ctx.dtype), ctx.group, ctx.size)
        return out, None, None, None, None


def all_gather(x: Tensor, group: Any, size: int, dtype: torch.dtype | None = None) -> Tensor:
    return _Exchange.apply(x, group, size, True, dtype)


def reduce_scatter(x: Tensor, group: Any, size: int) -> Tensor:
    return _Exchange.apply(x, group, size, False)


@dataclass(frozen=True)
class VocabShard:
    """Which rows of the ``[vocab, hidden]`` weight a rank computes with, and the groups it talks to."""

    vocab: int
    world: int  # trainer ranks: the weight's DTensor is Shard(0) over all of them
    cp: int
    rank: int  # this rank's index in its cp group
    cp_group: Any
    dp_group: Any  # ranks {g * cp + rank}: the peers whose rows this rank gathers (None when dp = 1)
    dtype: torch.dtype | None = None  # compute dtype (FSDP's param_dtype); None: the weight's

    @property
    def dp(self) -> int:
        return self.world // self.cp

    @property
    def block(self) -> int:
        """Rows per trainer rank (torch.chunk's ceil-sized shards, the last short or empty)."""
        return -(-self.vocab // self.world)

    def columns(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(held [N] bool, column [N]) of token ids in this rank's gathered rows (column 0 where not held)."""
        owner = torch.div(ids, self.block, rounding_mode="floor")
        held = owner % self.cp == self.rank
        col = torch.div(owner, self.cp, rounding_mode="floor") * self.block + ids % self.block
        return held, torch.where(held, col, torch.zeros_like(col))

    def padding(self) -> list[tuple[int, int]]:
        """Column ranges of the gathered rows past the vocabulary (the short or empty last shards);
        plain ints, so masking them costs no device sync."""
        out = []
        for g in range(self.dp):
            valid = min(max(self.vocab - (g * self.cp + self.rank) * self.block, 0), self.block)
            if valid < self.block:
                out.append((g * self.block + valid, (g + 1) * self.block))
        return out

    def column_of(self, token: int) -> int | None:
        """:meth:`columns` of one id in Python (None: another rank holds it)."""
        owner = token // self.block
        return (owner // self.cp) * self.block + token % self.block if owner % self.cp == self.rank else None

    def rows(self, weight: Tensor) -> Tensor:
        """This rank's gathered rows ``[dp * block, H]`` of the sharded ``weight`` in the compute dtype
        (differentiable: cast before the gather, the gradient reduced in the weight's dtype)."""
        local = weight.to_local() if hasattr(weight, "to_local") else weight
        if local.shape[0] < self.block:
            local = F.pad(local, (0, 0, 0, self.block - local.shape[0]))
        if self.dp > 1:
            return all_gather(local, self.dp_group, self.dp, self.dtype)
        return local if self.dtype is None else local.to(self.dtype)

    def gather(self, x: Tensor, n_max: int, fill: float = 0) -> Tensor:
        """``x`` ([n, ...], n <= n_max) of every rank of the cp group, each padded to n_max rows."""
        if x.shape[0] < n_max:
            x = torch.cat([x, x.new_full((n_max - x.shape[0], *x.shape[1:]), fill)])
        return all_gather(x, self.cp_group, self.cp)

    def longest(self, n: int, device: torch.device) -> int:
        t = torch.tensor(float(n), device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.cp_group)
        return int(t.item())

    # -------------------------------------------------------------------------------- the two layers
    def embed(self, emb: nn.Embedding, ids: Tensor) -> Tensor:
        """``emb(ids)`` with the rows spread over the cp group. Collective over it."""
        flat = ids.reshape(-1)
        n_max = self.longest(flat.numel(), flat.device)
        all_ids = self.gather(flat, n_max)
        held, col = self.columns(all_ids)
        w = self.rows(emb.weight)
        # the padding row gets no gradient (nn.Embedding's contract)
        pad_idx = None if emb.padding_idx is None else self.column_of(emb.padding_idx % self.vocab)
        part = F.embedding(col, w, pad_idx) * held[:, None].to(w.dtype)
        mine = reduce_scatter(part, self.cp_group, self.cp)[: flat.numel()]
        return mine.view(*ids.shape, w.shape[-1])

    def logprobs(
        self, head: nn.Linear, h: Tensor, labels: Tensor, temp: Tensor | None, chunk: int, entropy: bool
    ) -> tuple[Tensor, Tensor]:
        """(logprobs [K], entropy [K] or empty) of this rank's ``h`` [K, H], as
        :func:`hpcrl.models.chunked.chunked_token_logprobs`. Collective over the cp group."""
        k = h.shape[0]
        k_max = self.longest(k, h.device)
        h_all = self.gather(h, k_max)
        with torch.no_grad():
            lab_all = self.gather(labels, k_max)
            t_all = None if temp is None else self.gather(temp, k_max, fill=1.0)
        picked, ent = _VocabLogprobs.apply(
            h_all, self.rows(head.weight), lab_all, t_all, self, chunk, entropy
        )
        mine = slice(self.rank * k_max, self.rank * k_max + k)
        return picked[mine], (ent[mine] if entropy else ent)


class _VocabLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        h: Tensor,
        w: Tensor,
        labels: Tensor,
        temp: Tensor | None,
        shard: VocabShard,
        chunk: int,
        entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        n = h.shape[0]
        held, col = shard.columns(labels)
        pad = shard.padding()
        stats = torch.zeros(n, 3, dtype=torch.float32, device=h.device)  # local lse, E[z], picked z
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            z = _chunk_logits(h[a:b], w, None if temp is None else temp[a:b])
            for lo, hi in pad:
                z[:, lo:hi] = PAD_LOGIT
            m = z.amax(-1)
            z.sub_(m[:, None])
            s = torch.empty(b - a, device=h.device)
            pz = torch.empty(b - a, device=h.device)
            rows = _exp_rows(z)
            for r in range(0, b - a, rows):
                p = z[r : r + rows].exp()
                s[r : r + rows] = p.sum(-1)
                if entropy:
                    pz[r : r + rows] = (p[:, None, :] @ z[r : r + rows, :, None])[:, 0, 0]
                del p
            pick = z.gather(1, col[a:b, None])[:, 0] + m
            stats[a:b, 0] = m + s.log()
            if entropy:
                stats[a:b, 1] = pz / s + m
            stats[a:b, 2] = torch.where(held[a:b], pick, torch.full_like(pick, float("-inf")))
            del z
        every = _gather(stats[None], shard.cp_group, shard.cp)  # [cp, n, 3]
        lse = torch.logsumexp(every[:, :, 0], 0)
        picked = every[:, :, 2].amax(0) - lse
        ent = lse - (torch.exp(every[:, :, 0] - lse) * every[:, :, 1]).sum(0) if entropy else lse.new_zeros(0)
        ctx.save_for_backward(h, w, labels, temp, lse)
        ctx.shard, ctx.chunk = shard, chunk
        ctx.mark_non_differentiable(ent)
        return picked, ent

    @staticmethod
    def backward(ctx, grad_picked: Tensor, _grad_ent: Tensor):  # type: ignore[override]
        h, w, labels, temp, lse = ctx.saved_tensors
        shard, chunk = ctx.shard, ctx.chunk
        # Each rank's loss reaches only its own rows; every rank's columns need every row's gradient.
        grad = grad_picked.float().contiguous()
        dist.all_reduce(grad, group=shard.cp_group)
        held, col = shard.columns(labels)
        pad = shard.padding()
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]  # a frozen head (LoRA): no grad_w
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        for a in range(0, h.shape[0], chunk):
            b = min(a + chunk, h.shape[0])
            t = None if temp is None else temp[a:b]
            g = _chunk_logits(h[a:b], w, t)
            for lo, hi in pad:
                g[:, lo:hi] = PAD_LOGIT
            g.sub_(lse[a:b, None]).exp_()  # the softmax over the whole vocabulary, this rank's columns
            g.mul_(-grad[a:b, None])
            # + the incoming gradient at the label, where this rank holds it (0 is added elsewhere)
            at_label = torch.where(held[a:b], grad[a:b], torch.zeros_like(grad[a:b]))
            g.index_put_((torch.arange(b - a, device=g.device), col[a:b]), at_label, accumulate=True)
            if t is not None:
                g /= t.unsqueeze(-1)
            g = g.to(w.dtype)
            if grad_h is not None:
                grad_h[a:b] = g @ w
            if grad_w is not None:
                grad_w.addmm_(g.t().float(), h[a:b].float())
            del g
        gw = None if grad_w is None else grad_w.to(w.dtype)
        return grad_h, gw, None, None, None, None, None


# ------------------------------------------------------------------------------------ installing
def supported(model: nn.Module) -> str | None:
    """Why the model's embedding / head cannot be vocabulary-parallel (None: they can)."""
    emb, head = embeddings(model)
    if type(emb) is not nn.Embedding:
        return f"the input embedding is a {type(emb).__name__}, not a plain nn.Embedding (LoRA on it?)"
    if type(head) is not nn.Linear or head.bias is not None:
        return "the LM head is not a plain bias-free nn.Linear (LoRA on it?)"
    if emb.max_norm is not None or emb.scale_grad_by_freq or emb.sparse:
        return "the input embedding uses max_norm, scale_grad_by_freq or sparse gradients"
    if (emb.num_embeddings, emb.embedding_dim) != (head.out_features, head.in_features):
        return "the input embedding and the LM head differ in vocabulary or hidden size"
    return None


def parameters(model: nn.Module) -> set[nn.Parameter]:
    """The weights FSDP must leave alone (the embedding's and the head's, once when tied)."""
    emb, head = embeddings(model)
    return {emb.weight, head.weight}  # type: ignore[union-attr]


def shard(
    model: nn.Module, cp_size: int, cp_rank: int, cp_group: Any, dtype: torch.dtype | None
) -> VocabShard:
    """Make the embedding and head weights ``Shard(0)`` DTensors over all ranks (as FSDP does, on its
    mesh) and route both layers through a :class:`VocabShard`. Call after FSDP sharded the rest
    (with :func:`parameters` ignored), before meta-device materialisation. Collective."""
    from torch.distributed.tensor import DTensor, Shard

    emb, head = embeddings(model)
    # FSDP's mesh of all ranks (not an expert-parallel mesh, named "ep": experts may come first)
    mesh = next(
        p.device_mesh
        for p in model.parameters()
        if isinstance(p, DTensor) and "ep" not in (p.device_mesh.mesh_dim_names or ())
    )
    world, me = dist.get_world_size(), dist.get_rank()
    dp_group = None
    for r in range(cp_size):  # new_group is collective: every rank creates every dp group
        g = dist.new_group([d * cp_size + r for d in range(world // cp_size)]) if world > cp_size else None
        if r == cp_rank:
            dp_group = g
    vs = VocabShard(int(head.weight.shape[0]), world, cp_size, cp_rank, cp_group, dp_group, dtype)  # type: ignore[union-attr]
    done: dict[int, nn.Parameter] = {}
    for mod in (emb, head):
        w = mod.weight  # type: ignore[union-attr]
        if id(w) not in done:
            first = min(me * vs.block, vs.vocab)
            local = w.detach().narrow(0, first, min(vs.block, vs.vocab - first)).clone()
            d = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=w.shape, stride=w.stride())
            done[id(w)] = nn.Parameter(d, requires_grad=w.requires_grad)
        mod.weight = done[id(w)]  # type: ignore[union-attr]
    emb.forward = lambda ids: vs.embed(emb, ids)  # type: ignore[union-attr, method-assign]
    head.hpcrl_vocab_shard = vs  # type: ignore[union-attr]
    return vs
