"""Packed-sequence forward: many samples in one row, no attention across sample boundaries, no padding.

A rank's batch arrives as flat arrays: ``input_ids [T]``, ``position_ids [T]``, ``seq_lens [S]`` and
per-token ``loss_mask`` / ``advantages`` / ``inference_logprobs`` (all aligned with ``input_ids``:
the value at ``t`` is about token ``t``). We cut it into micro-batches of whole samples, run each
as ONE row of concatenated samples, and return per-token logprobs aligned the same way, so they
compare one-to-one with the inference logprobs.

How sample boundaries are kept apart depends on the attention kernel:

* ``sdpa`` / ``eager`` (CPU, tests): an explicit block-diagonal causal 4D mask; transformers passes
  a 4D mask through untouched. Independent of how position ids look.
* ``flash_attention_2`` and other kernels: no mask; transformers detects the packed layout from
  ``position_ids`` restarting at 0 and runs varlen attention. We check that they do restart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

IGNORE_INDEX = -100
_MASKED_KERNELS = ("sdpa", "eager")


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
            if v is None or f.name in ("seq_lens", "temperatures"):
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
            if v is None:
                out[f.name] = None
            elif f.name in ("seq_lens", "temperatures"):
                out[f.name] = v[start:end]
            else:
                out[f.name] = v[t0:t1]
        return PackedBatch(**out)

    def to(self, device: torch.device | str) -> PackedBatch:
        return replace(self, **{f.name: _to(getattr(self, f.name), device) for f in fields(self)})


def _to(x: Tensor | None, device: torch.device | str) -> Tensor | None:
    return None if x is None else x.to(device, non_blocking=True)


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
    return [batch.slice_samples(a, b) for a, b in split_micro_batches(batch.seq_lens, micro_batch_tokens)]


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


def shift_labels(input_ids: Tensor, seq_lens: Tensor) -> Tensor:
    """``labels[t] = input_ids[t + 1]`` within a sample; IGNORE_INDEX at each sample's last token."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:-1] = input_ids[1:]
    ends = torch.cumsum(seq_lens, 0) - 1
    labels[ends] = IGNORE_INDEX
    return labels


def token_logprobs(logits: Tensor, labels: Tensor, temperature: Tensor | float = 1.0) -> Tensor:
    """``log softmax(logits[t] / temperature)[labels[t]]`` in fp32; 0 where ``labels == IGNORE_INDEX``.

    Position ``t`` holds the logprob of the NEXT token (pass :func:`shift_labels`). Dividing by the
    sample's sampling temperature makes these comparable with the logprobs the sampler reported."""
    logits = _scaled(logits, temperature)
    valid = labels != IGNORE_INDEX
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    picked = logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    lp = picked - torch.logsumexp(logits, dim=-1)
    return torch.where(valid, lp, torch.zeros_like(lp))


def token_entropy(logits: Tensor, temperature: Tensor | float = 1.0) -> Tensor:
    """Entropy of the (temperature-scaled) next-token distribution at every position, fp32, no grad."""
    with torch.no_grad():
        logp = torch.log_softmax(_scaled(logits, temperature), dim=-1)
        return -(logp.exp() * logp).sum(-1)


def _scaled(logits: Tensor, temperature: Tensor | float) -> Tensor:
    logits = logits.float()
    if isinstance(temperature, Tensor):
        return logits / temperature.float().unsqueeze(-1)
    return logits if temperature == 1.0 else logits / temperature


def align_to_inputs(pred: Tensor, seq_lens: Tensor) -> Tensor:
    """Move next-token values (``pred[t]`` is about token ``t+1``) onto the token they describe;
    each sample's first token gets 0 (nothing predicts it)."""
    out = torch.cat([pred.new_zeros(1), pred[:-1]])
    starts = torch.zeros_like(out, dtype=torch.bool)
    starts[sample_starts(seq_lens)] = True
    return torch.where(starts, torch.zeros_like(out), out)


@dataclass
class ForwardOutput:
    logprobs: Tensor  # [T] fp32 with grad, aligned with input_ids (0 at sample starts)
    entropy: Tensor | None  # [T] fp32 detached, same alignment


def attention_mask_for(model: torch.nn.Module, mb: PackedBatch) -> Tensor | None:
    """The mask argument that keeps samples apart for this model's attention kernel."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"
    if impl in _MASKED_KERNELS:
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


def forward_packed(model: torch.nn.Module, mb: PackedBatch, *, compute_entropy: bool = True) -> ForwardOutput:
    """Run ``model`` over one micro-batch as a single packed row; logprobs keep the graph."""
    mask = attention_mask_for(model, mb)
    out = model(
        input_ids=mb.input_ids.unsqueeze(0),
        position_ids=mb.position_ids.unsqueeze(0),
        attention_mask=mask,
        use_cache=False,
    )
    logits = out.logits[0]  # [T, V]
    if mb.temperatures is None:
        temp: Tensor | float = 1.0
    else:
        # The temperature that sampled token t+1 is its sample's, i.e. the same as token t's.
        temp = torch.repeat_interleave(mb.temperatures.to(logits.device), mb.seq_lens.to(logits.device))
    labels = shift_labels(mb.input_ids, mb.seq_lens)
    lp = align_to_inputs(token_logprobs(logits, labels, temp), mb.seq_lens)
    ent = align_to_inputs(token_entropy(logits, temp), mb.seq_lens) if compute_entropy else None
    return ForwardOutput(logprobs=lp, entropy=ent)
