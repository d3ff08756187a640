"""Packed-sequence forward: whole samples per micro-batch, no attention across sample boundaries.

A rank's batch arrives as flat arrays: ``input_ids [T]``, ``position_ids [T]``, ``seq_lens [S]`` and
per-token ``loss_mask`` / ``advantages`` / ``inference_logprobs`` (all aligned with ``input_ids``:
the value at ``t`` is about token ``t``). We cut it into micro-batches of whole samples and return
per-token logprobs aligned the same way, so they compare one-to-one with the inference logprobs.

How a micro-batch meets the model depends on the attention kernel:

* ``flash_attention_2`` and other varlen kernels (GPU): ONE packed row, no mask; transformers finds
  sample boundaries where ``position_ids`` restart at 0 (we check that they do). No padding at all.
* ``sdpa`` / ``eager`` (CPU, tests): no varlen kernel, so a single packed row would need a dense
  ``[T, T]`` block-diagonal mask and cost ``T^2`` attention. Instead the samples are laid out in
  rows (as wide as the longest sample, or wider when that pads less: ``layout.choose_width``), with a per-row block-causal 4D mask (transformers passes 4D
  masks through untouched), and samples that begin with the same tokens (a prompt's n completions)
  compute that prefix once: see :mod:`hpcrl.trainer.layout`. Token slots computed (padding at row
  ends, shared prefixes counted once) are reported as ``ForwardOutput.slots``.

Only the positions that predict a wanted token (the loss mask) go through the LM head and the
log-softmax (``logits_to_keep``), which is where a large vocabulary spends its time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from hpcrl.models.chunked import can_chunk, head_logprobs, kept_logits
from hpcrl.trainer.layout import (
    RowLayout,
    choose_width,
    key_cost_of,
    place_units,
    row_layout,
    shared_prefixes,
    unit_slots,
    units_of,
)

MASKED_KERNELS = ("sdpa", "eager")
_PER_SAMPLE = ("seq_lens", "temperatures", "prefix_lens", "env_index")
_HINTS = ("row_width",)  # plain values carried along unchanged by slicing, selection and .to()


@dataclass
class PackedBatch:
    """Torch view of one rank's packed train batch (or a micro-batch of it)."""

    input_ids: Tensor  # [T] long
    position_ids: Tensor  # [T] long
    seq_lens: Tensor  # [S] long, sum == T
    loss_mask: Tensor  # [T] bool
    advantages: Tensor | None = None  # [T] float
    inference_logprobs: Tensor | None = None  # [T] float, logprob of token t under the sampler
    temperatures: Tensor | None = None  # [S] float, sampling temperature per sample (None: 1.0)
    teacher_logprobs: Tensor | None = None  # [T] float (opd)
    ref_logprobs: Tensor | None = None  # [T] float (KL to a reference policy)
    # [S] long: tokens a sample shares with the previous one's unit (layout.shared_prefixes);
    # None or all 0: no sharing. Only masked kernels use it; varlen kernels run samples in full.
    prefix_lens: Tensor | None = None
    # Masked kernels: the row width row_micro_batches packed this micro-batch's units at (so its
    # layout reproduces those rows); None: layout.row_layout decides. Not a tensor: never sliced.
    row_width: int | None = None
    # [T, layers*k] expert ids the inference engine routed each token to (MoE router replay; -1 = route
    # freely). Only the custom implementation takes it (transformers' models route on their own).
    routed_experts: Tensor | None = None
    # [S] long: the sample's environment, an index into the trainer's env names (per-env metrics only)
    env_index: Tensor | None = None
    ce_weights: Tensor | None = None  # [T] float: echo's cross-entropy weight (0 = none), outside loss_mask

    def trained(self) -> Tensor:
        """[T] bool: the tokens whose logprob a loss uses (the loss mask, and echo's ce tokens)."""
        mask = self.loss_mask.bool()
        return mask if self.ce_weights is None else mask | (self.ce_weights != 0)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_samples(self) -> int:
        return int(self.seq_lens.numel())

    def validate(self) -> None:
        """ValueError for a malformed batch (these arrive from another process)."""
        t = self.num_tokens
        if int(self.seq_lens.sum()) != t:
            raise ValueError(f"sum(seq_lens) = {int(self.seq_lens.sum())} but input_ids has {t} tokens")
        if self.num_samples and int(self.seq_lens.min()) < 1:
            raise ValueError("seq_lens must all be >= 1")
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None or f.name in _PER_SAMPLE or f.name in _HINTS:
                continue
            if f.name == "routed_experts":
                if v.dim() != 2 or v.shape[0] != t:
                    raise ValueError(f"routed_experts has shape {tuple(v.shape)}, expected ({t}, layers*k)")
                continue
            if v.shape != (t,):
                raise ValueError(f"{f.name} has shape {tuple(v.shape)}, expected ({t},)")
        if self.temperatures is not None and self.temperatures.shape != (self.num_samples,):
            raise ValueError(
                f"temperatures has shape {tuple(self.temperatures.shape)}, expected ({self.num_samples},)"
            )
        if t and bool(self.loss_mask.bool()[sample_starts(self.seq_lens)].any()):
            raise ValueError(
                "loss_mask is set on the first token of a sample: per-token arrays are aligned with "
                "input_ids and a sample's first token has no prefix to predict it from"
            )

    def slice_samples(self, start: int, end: int) -> PackedBatch:
        """Samples ``start .. end-1`` as a new batch (views, no copy)."""
        offsets = torch.cumsum(self.seq_lens, 0)
        t0 = int(offsets[start - 1]) if start > 0 else 0
        t1 = int(offsets[end - 1]) if end > 0 else 0
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None or f.name in _HINTS:
                out[f.name] = v
            elif f.name in _PER_SAMPLE:
                out[f.name] = v[start:end]
            else:
                out[f.name] = v[t0:t1]
        return PackedBatch(**out)

    def select_samples(self, order: Sequence[int]) -> PackedBatch:
        """The samples ``order`` (indices, in that order) as a new batch (copies)."""
        offsets = (torch.cumsum(self.seq_lens, 0) - self.seq_lens).tolist()
        lens = self.seq_lens.tolist()
        dev = self.seq_lens.device
        tok = (
            torch.cat([torch.arange(offsets[i], offsets[i] + lens[i], device=dev) for i in order])
            if order
            else torch.zeros(0, dtype=torch.long, device=dev)
        )
        idx = torch.tensor(list(order), dtype=torch.long, device=dev)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v if v is None or f.name in _HINTS else v[idx] if f.name in _PER_SAMPLE else v[tok]
        return PackedBatch(**out)

    def to(self, device: torch.device | str) -> PackedBatch:
        return replace(self, **{f.name: _to(getattr(self, f.name), device) for f in fields(self)})


def _to(x: Tensor | int | None, device: torch.device | str) -> Tensor | int | None:
    return x.to(device, non_blocking=True) if isinstance(x, Tensor) else x


def split_micro_batches(seq_lens: Sequence[int] | Tensor, micro_batch_tokens: int) -> list[tuple[int, int]]:
    """Greedy, order-preserving split into ``[start, end)`` sample ranges of <= ``micro_batch_tokens``.

    Whole samples only; a sample longer than the budget gets a micro-batch of its own. Order is
    kept so a run is reproducible and the rank-split equals the single-rank batch sample for sample."""
    if micro_batch_tokens < 1:
        raise ValueError(f"micro_batch_tokens must be >= 1, got {micro_batch_tokens}")
    lens = [int(x) for x in seq_lens]
    ranges: list[tuple[int, int]] = []
    start, used = 0, 0
    for i, n in enumerate(lens):
        if used and used + n > micro_batch_tokens:
            ranges.append((start, i))
            start, used = i, 0
        used += n
    if used:
        ranges.append((start, len(lens)))
    return ranges


def micro_batches(batch: PackedBatch, micro_batch_tokens: int) -> list[PackedBatch]:
    """Micro-batches of whole units (a sample, or samples sharing a prefix), by token slots."""
    pl = None if batch.prefix_lens is None else batch.prefix_lens.tolist()
    units = units_of(pl, batch.num_samples)
    sizes = unit_slots(units, batch.seq_lens.tolist())
    return [
        batch.slice_samples(units[a][0], units[b - 1][1])
        for a, b in split_micro_batches(sizes, micro_batch_tokens)
    ]


def row_micro_batches(
    batch: PackedBatch, micro_batch_tokens: int, key_cost: float | None = None
) -> list[PackedBatch]:
    """Micro-batches for masked kernels (CPU): the whole batch's units packed first-fit decreasing
    into rows as wide as the longest unit (with ``key_cost``: as wide as ``layout.choose_width``
    picks, at most ``micro_batch_tokens`` unless a unit is longer), then runs of
    ``micro_batch_tokens // width`` rows (at least one). Packing once per batch instead of once per
    micro-batch leaves padding only in the batch's last rows. Samples are reordered (units stay
    whole, heads first); the loss is a sum over tokens, so the order does not matter.
    Deterministic."""
    if batch.num_samples == 0:
        return []
    pl = None if batch.prefix_lens is None else batch.prefix_lens.tolist()
    units = units_of(pl, batch.num_samples)
    sizes = unit_slots(units, batch.seq_lens.tolist())
    width = max(sizes) if key_cost is None else choose_width(sizes, key_cost, max_width=micro_batch_tokens)
    starts = place_units(sizes, width)
    per_mb = max(1, micro_batch_tokens // width)
    groups: dict[int, list[int]] = {}
    for u in sorted(range(len(units)), key=lambda i: starts[i]):
        groups.setdefault(starts[u] // width // per_mb, []).append(u)
    order: list[int] = []
    bounds: list[tuple[int, int]] = []
    for g in sorted(groups):
        first = len(order)
        for u in groups[g]:
            order.extend(range(units[u][0], units[u][1]))
        bounds.append((first, len(order)))
    # With a chosen width, each micro-batch's layout must reuse it to reproduce these rows.
    ordered = replace(batch.select_samples(order), row_width=None if key_cost is None else width)
    return [ordered.slice_samples(a, b) for a, b in bounds]


def with_shared_prefixes(batch: PackedBatch, micro_batch_tokens: int, key_cost: float = 512.0) -> PackedBatch:
    """``batch`` with ``prefix_lens`` set (see :func:`hpcrl.trainer.layout.shared_prefixes`)."""
    pl = shared_prefixes(
        batch.input_ids.cpu().numpy(),
        batch.position_ids.cpu().numpy(),
        batch.seq_lens.tolist(),
        micro_batch_tokens,
        key_cost,
        None if batch.routed_experts is None else batch.routed_experts.cpu().numpy(),
    )
    return replace(batch, prefix_lens=torch.from_numpy(pl).to(batch.seq_lens.device))


def dummy_micro_batch(device: torch.device | str = "cpu") -> PackedBatch:
    """One token, nothing trained. FSDP runs collectives in every forward/backward, so a rank with
    fewer micro-batches than its peers must still run as many passes: it runs these (loss exactly 0)."""
    one = torch.ones(1, dtype=torch.long, device=device)
    zf = torch.zeros(1, dtype=torch.float32, device=device)
    return PackedBatch(
        input_ids=torch.zeros(1, dtype=torch.long, device=device),
        position_ids=torch.zeros(1, dtype=torch.long, device=device),
        seq_lens=one,
        loss_mask=torch.zeros(1, dtype=torch.bool, device=device),
        advantages=zf,
        inference_logprobs=zf,
        temperatures=torch.ones(1, dtype=torch.float32, device=device),
    )


def sample_starts(seq_lens: Tensor) -> Tensor:
    """Index of each sample's first token in the packed row."""
    return torch.cumsum(seq_lens, 0) - seq_lens


def block_causal_mask(seq_lens: Tensor, dtype: torch.dtype = torch.bool) -> Tensor:
    """``[1, 1, T, T]`` mask: token q may attend to k iff same sample and k <= q.

    bool (True = attend) for sdpa; for a float dtype an additive mask (0 / most negative value),
    which is what eager attention adds to its scores."""
    seg = torch.repeat_interleave(torch.arange(len(seq_lens), device=seq_lens.device), seq_lens)
    t = seg.numel()
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(t, t, dtype=torch.bool, device=seg.device).tril()
    if dtype == torch.bool:
        return allowed[None, None]
    neg = torch.finfo(dtype).min
    return torch.where(allowed, 0.0, neg).to(dtype)[None, None]


def next_token_logprobs(
    logits: Tensor, labels: Tensor, temperature: Tensor | float = 1.0, *, entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """``log softmax(logits[i] / temperature)[labels[i]]`` in fp32 (with grad) and, if asked, the
    entropy of that distribution (no grad). Row ``i`` of ``logits`` is the position that predicts
    ``labels[i]``; dividing by the sample's sampling temperature makes the logprobs comparable with
    those the sampler reported."""
    logp = torch.log_softmax(_scaled(logits, temperature), dim=-1)
    picked = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    if not entropy:
        return picked, None
    with torch.no_grad():
        d = logp.detach()
        return picked, -(d.exp() * d).sum(-1)


def _scaled(logits: Tensor, temperature: Tensor | float) -> Tensor:
    logits = logits.float()
    if isinstance(temperature, Tensor):
        return logits / temperature.float().unsqueeze(-1)
    return logits if temperature == 1.0 else logits / temperature


@dataclass
class ForwardOutput:
    logprobs: Tensor  # [T] fp32 with grad, aligned with input_ids (0 at sample starts and unwanted tokens)
    entropy: Tensor | None  # [T] fp32 detached, same alignment
    slots: int = 0  # token slots the model computed (rows x width; a shared prefix counts once)
    padding: int = 0  # of which padding (row tails)


def attention_kernel(model: torch.nn.Module) -> str:
    return getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"


def attention_mask_for(model: torch.nn.Module, mb: PackedBatch) -> Tensor | None:
    """The mask that keeps samples apart when ``mb`` runs as ONE packed row (``[1, 1, T, T]`` for
    masked kernels; None for varlen kernels, which split on position ids restarting at 0)."""
    impl = attention_kernel(model)
    if impl in MASKED_KERNELS:
        dtype = torch.bool if impl == "sdpa" else _param_dtype(model)
        return block_causal_mask(mb.seq_lens.to(mb.input_ids.device), dtype)
    # Varlen kernels find boundaries where position ids restart at 0; make sure they do.
    starts = sample_starts(mb.seq_lens)
    if bool((mb.position_ids[starts] != 0).any()):
        raise ValueError(f"attention '{impl}' packs by position_ids: every sample must start at position 0")
    return None


def _param_dtype(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        return p.dtype
    return torch.float32


def model_inputs(
    model: torch.nn.Module, mb: PackedBatch
) -> tuple[dict[str, Tensor | None], RowLayout | None]:
    """Model arguments for a micro-batch: rows of whole units (samples, or samples sharing a prefix)
    for masked kernels (sdpa/eager: no varlen attention on CPU); one packed row for varlen kernels
    (flash-attention), which cannot express a shared prefix and run every sample in full."""
    impl = attention_kernel(model)
    routed = mb.routed_experts
    if impl not in MASKED_KERNELS:
        inputs = {
            "input_ids": mb.input_ids[None],
            "position_ids": mb.position_ids[None],
            "attention_mask": attention_mask_for(model, mb),
        }
        if routed is not None:
            inputs["routed_experts"] = routed[None]
        return inputs, None
    dev = mb.input_ids.device
    layout = row_layout(
        mb.seq_lens.to(dev),
        None if mb.prefix_lens is None else mb.prefix_lens.to(dev),
        key_cost_of(getattr(model, "config", None)),
        width=mb.row_width,
    )
    dtype = torch.bool if impl == "sdpa" else _param_dtype(model)
    # One sample alone in one unpadded row (a long sample in its own micro-batch) is plain causal
    # attention: no mask lets the kernel use is_causal instead of a [T, T] mask (at 16k tokens the
    # bool mask is 256 MiB and sdpa's CPU kernel keeps a float copy, 1 GiB, for the backward).
    alone = layout.rows == 1 and mb.num_samples == 1 and layout.padding == 0
    inputs = {
        "input_ids": layout.grid(mb.input_ids),
        "position_ids": layout.grid(mb.position_ids),
        "attention_mask": None if alone else layout.mask(dtype),
    }
    if routed is not None:
        inputs["routed_experts"] = layout.grid(routed, -1)
    return inputs, layout


def forward_packed(
    model: torch.nn.Module,
    mb: PackedBatch,
    *,
    compute_entropy: bool = True,
    wanted: Tensor | None = None,
    chunk_tokens: int = 0,
) -> ForwardOutput:
    """Run ``model`` over one micro-batch; logprobs keep the graph.

    ``wanted`` ([T] bool, e.g. the loss mask) names the tokens whose logprob the caller uses: logits
    (the LM head and the log-softmax) are computed only at the positions that predict them, and the
    other entries are 0. None: every token but each sample's first. ``chunk_tokens > 0``: the LM head
    and log-softmax run that many positions at a time (:mod:`hpcrl.models.chunked`), so no
    ``[kept, vocab]`` tensor exists; 0 (or a head that is not a plain Linear): all kept positions at once."""
    dev = mb.input_ids.device
    seq_lens = mb.seq_lens.to(dev)
    t = mb.num_tokens
    target = torch.ones(t, dtype=torch.bool, device=dev) if wanted is None else wanted.to(dev).bool().clone()
    target[sample_starts(seq_lens)] = False  # nothing predicts a sample's first token
    predictors = torch.zeros_like(target)
    predictors[:-1] = target[1:]  # position p predicts token p + 1
    inputs, layout = model_inputs(model, mb)
    pos = predictors.nonzero()[:, 0]
    slots = pos if layout is None else layout.index[pos]  # shared-prefix positions repeat
    n_slots = t if layout is None else layout.rows * layout.width
    keep = torch.zeros(n_slots, dtype=torch.bool, device=dev)
    keep[slots] = True
    rank = torch.cumsum(keep, 0) - 1  # row of each kept slot in the model's [kept, V] output
    keep_2d = keep[None] if layout is None else keep.view(layout.rows, layout.width)
    if mb.temperatures is None:
        temp: Tensor | float = 1.0
    else:
        # The temperature that sampled token p+1 is its sample's, i.e. the same as token p's.
        sample = torch.repeat_interleave(torch.arange(mb.num_samples, device=dev), seq_lens)
        temp = mb.temperatures.to(dev)[sample[pos]]
    repeats = slots.numel() > 1 and not bool((slots[1:] > slots[:-1]).all())
    labels = mb.input_ids[pos + 1]
    if chunk_tokens > 0 and can_chunk(model):
        picked, ent_p = head_logprobs(
            model,
            inputs,
            keep_2d,
            labels,
            temp,
            chunk=chunk_tokens,
            entropy=compute_entropy,
            index=rank[slots] if repeats else None,  # a shared position predicts a token of every member
        )
    else:
        logits = kept_logits(model, inputs, keep_2d)  # [kept, V], row-major
        if repeats:
            logits = logits[rank[slots]]  # a shared position predicts a token of every member
        picked, ent_p = next_token_logprobs(logits, labels, temp, entropy=compute_entropy)
    lp = torch.zeros(t, dtype=picked.dtype, device=dev).index_copy(0, pos + 1, picked)
    ent = (
        None if ent_p is None else torch.zeros(t, dtype=ent_p.dtype, device=dev).index_copy(0, pos + 1, ent_p)
    )
    return ForwardOutput(
        logprobs=lp, entropy=ent, slots=n_slots, padding=0 if layout is None else layout.padding
    )
