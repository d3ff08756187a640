"""Token logprobs (and entropy) through the LM head in chunks of positions: no ``[tokens, vocab]``
tensor ever exists.

At Qwen3's vocabulary (151,936) one position's fp32 logits are 594 KiB: 32k positions are 19.9 GB,
and a ``log_softmax`` with autograd keeps as much again. :class:`ChunkedLogprobs` is a custom
autograd Function: its forward runs the LM head, the log-softmax and the pick chunk by chunk and
keeps only the hidden states (``[K, H]``) and the labels; its backward
recomputes each chunk's logits and writes the gradient analytically
(``d logp[y] / d z = onehot(y) - softmax(z)``), so one chunk's ``[C, V]`` buffer is the whole
vocabulary-sized memory of the step, forward and backward: the log-softmax, the softmax and the
gradient are computed in place in the buffer of the logits (their exp() sums take a few rows'
``[rows, V]`` temporary more, :data:`EXP_BYTES`). We chose the custom Function over a
checkpointed per-chunk closure because the closure's backward goes through autograd's
``log_softmax`` backward, which holds the logits, the log-softmax and its gradient per chunk (three
``[C, V]`` buffers instead of one) and recomputes the forward a second time for nothing; the
Function also accumulates the LM-head gradient in one buffer instead of one autograd node per chunk.

Numerics match the unchunked path: logits are computed in the weight's dtype and upcast to fp32
(what ``lm_head(h).float()`` does), divided by the sampling temperature, then log-softmaxed in fp32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from hpcrl.models.embeddings import lm_head

# Positions per chunk where no config reaches (the inference engine's prompt logprobs), and the
# default of trainer.model.logprobs_chunk_tokens: an upper bound; CHUNK_MIB bounds the chunk in bytes.
DEFAULT_CHUNK = 256
# The default of trainer.model.logprobs_chunk_mib (0: no bound). A bound of 32 MiB makes a chunk 55
# rows at Qwen3's 151,936 (the 256 rows' buffer is 148 MiB): free on CPU (the head's forward + backward
# took the same CPU time), but on an H200 55-row chunks re-read the LM head's weight 4.7x as often
# and a Qwen3-1.7B step at 16k tokens took 1.16 s instead of 1.01 (tiny-qwen3-151k: 0.12-0.15 s
# instead of 0.105), with the same peak; see docs/trainer.md.
CHUNK_MIB = 0.0
# Rows of a chunk exponentiated at once for a sum (a [rows, V] fp32 temporary), bounded in bytes per
# device kind. CPU: 6 rows at vocab 151,936 (32 rows, what it was, took 18.5 MiB; same CPU time). GPU:
# each slice is a few kernel launches, so rows are cheap memory and dear time: on an H200, Qwen3's head
# (hidden 2048) over 16k positions in 256-row chunks took 647 / 441 / 416 ms forward + backward with
# 6 / 32 / 64 rows (`python scripts/bench/gpu.py --parts head`); 40 MiB gives 64 rows there.
EXP_BYTES = 4 * 2**20
EXP_BYTES_GPU = 40 * 2**20


def chunk_rows(tokens: int, vocab: int, mib: float) -> int:
    """Positions per chunk: ``tokens``, fewer if one fp32 ``[rows, vocab]`` buffer would exceed
    ``mib`` MiB (0: no bound), at least 1. ``tokens`` 0 (chunking off) stays 0."""
    if tokens <= 0 or mib <= 0:
        return max(tokens, 0)
    return max(1, min(tokens, int(mib * 2**20) // (4 * vocab)))


def _exp_rows(z: Tensor) -> int:
    return max(1, (EXP_BYTES if z.device.type == "cpu" else EXP_BYTES_GPU) // (4 * z.shape[-1]))


def _chunk_logits(h: Tensor, weight: Tensor, temp: Tensor | None) -> Tensor:
    """``(h @ weight.T).float() / temp``, the temperature applied in place: ONE ``[C, V]`` buffer."""
    z = (h @ weight.t()).float()
    return z if temp is None else z.div_(temp.unsqueeze(-1))


def _log_softmax_(z: Tensor) -> Tensor:
    """``log_softmax(z, -1)`` in place, as torch computes it (``z - max - log(sum(exp(z - max)))``):
    the sum's exp() runs a few rows at a time (:data:`EXP_BYTES`), so no second ``[C, V]`` buffer exists."""
    z.sub_(z.amax(-1, keepdim=True))
    lse = torch.empty(z.shape[0], 1, dtype=z.dtype, device=z.device)
    rows = _exp_rows(z)
    for r in range(0, z.shape[0], rows):
        lse[r : r + rows] = z[r : r + rows].exp().sum(-1, keepdim=True).log_()
    return z.sub_(lse)


def _neg_plogp(logp: Tensor) -> Tensor:
    """``-sum(exp(logp) * logp)`` per row (the entropy), as a batched dot product."""
    return -(logp.exp()[:, None, :] @ logp[:, :, None])[:, 0, 0]


class ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, hidden: Tensor, weight: Tensor, labels: Tensor, temp: Tensor | None, chunk: int, entropy: bool
    ) -> tuple[Tensor, Tensor]:
        k = hidden.shape[0]
        picked = torch.empty(k, dtype=torch.float32, device=hidden.device)
        ent = torch.zeros(k if entropy else 0, dtype=torch.float32, device=hidden.device)
        for a in range(0, k, chunk):
            b = min(a + chunk, k)
            logp = _log_softmax_(_chunk_logits(hidden[a:b], weight, None if temp is None else temp[a:b]))
            picked[a:b] = logp.gather(-1, labels[a:b, None])[:, 0]
            if entropy:  # -sum p log p as batched dot products, a few rows at a time
                rows = _exp_rows(logp)
                for r in range(0, b - a, rows):
                    ent[a + r : min(a + r + rows, b)] = _neg_plogp(logp[r : r + rows])
            del logp  # no view of it may outlive this line: it would keep the [C, V] buffer alive
        ctx.save_for_backward(hidden, weight, labels, temp)
        ctx.chunk = chunk
        ctx.mark_non_differentiable(ent)
        return picked, ent

    @staticmethod
    def backward(ctx, grad_picked: Tensor, _grad_ent: Tensor):  # type: ignore[override]
        hidden, weight, labels, temp = ctx.saved_tensors
        chunk = ctx.chunk
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        rows = torch.arange(min(chunk, hidden.shape[0]), device=hidden.device)
        for a in range(0, hidden.shape[0], chunk):
            b = min(a + chunk, hidden.shape[0])
            t = None if temp is None else temp[a:b]
            # d picked / d z = onehot(label) - softmax(z), times the incoming gradient; softmax as
            # exp(log_softmax) is what autograd's LogSoftmaxBackward uses, so the two agree to rounding.
            # All in place in the logits' buffer: the chunk's only [C, V] tensor.
            g = _log_softmax_(_chunk_logits(hidden[a:b], weight, t)).exp_()
            g.mul_(-grad_picked[a:b, None].float())
            g[rows[: b - a], labels[a:b]] += grad_picked[a:b].float()
            if t is not None:
                g /= t.unsqueeze(-1)  # z = raw / temperature
            g = g.to(weight.dtype)
            if need_h:
                grad_h[a:b] = g @ weight  # type: ignore[index]
            if need_w:
                grad_w.addmm_(g.t().float(), hidden[a:b].float())  # type: ignore[union-attr]
            del g
        gw = None if grad_w is None else grad_w.to(weight.dtype)
        return grad_h, gw, None, None, None, None


def chunked_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: Tensor | float = 1.0,
    *,
    chunk: int,
    entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``log softmax((hidden @ weight.T) / temperature)[labels]`` per row (fp32, differentiable in
    ``hidden`` and ``weight``) and, if asked, the entropy of each row's distribution (no grad),
    ``chunk`` rows at a time. ``temperature``: a float or one value per row."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    temp = row_temperatures(temperature, hidden)
    picked, ent = ChunkedLogprobs.apply(hidden, weight, labels, temp, chunk, entropy)
    return picked, (ent if entropy else None)


def row_temperatures(temperature: Tensor | float, hidden: Tensor) -> Tensor | None:
    """One fp32 temperature per row of ``hidden`` (None for a plain 1.0: no division at all)."""
    if isinstance(temperature, Tensor):
        return temperature.float().to(hidden.device)
    if temperature == 1.0:
        return None
    return torch.full((hidden.shape[0],), float(temperature), device=hidden.device)


def can_chunk(model: torch.nn.Module) -> bool:
    """Whether the LM head is a plain bias-free ``nn.Linear`` (what the chunked path replaces); a
    LoRA-wrapped or biased head falls back to full logits."""
    head = lm_head(model)
    return type(head) is torch.nn.Linear and head.bias is None


def head_logprobs(
    model: torch.nn.Module,
    inputs: dict,
    keep: Tensor,
    labels: Tensor,
    temperature: Tensor | float = 1.0,
    *,
    chunk: int,
    entropy: bool = False,
    index: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Run ``model`` on ``inputs`` with its LM head replaced, for this call, by
    :func:`chunked_token_logprobs` over the ``keep`` positions (``logits_to_keep``, row-major;
    ``index`` reorders/repeats them first). Returns (logprobs [K], entropy [K] or None).

    The head runs INSIDE the model's forward on purpose: FSDP2 gathers the root's parameters (the
    LM head, tied embeddings) for the forward and again before the backward of the root's output;
    outside the forward the weight is a sharded DTensor. The model's ``logits`` output is then the
    ``[K, 1]`` logprobs, so FSDP's backward hooks sit on what the loss uses. A head made
    vocabulary-parallel (:mod:`hpcrl.models.vocab_parallel`) computes its own columns over the cp
    group's rows."""
    head = lm_head(model)
    vocab = getattr(head, "hpcrl_vocab_shard", None)
    ent: list[Tensor | None] = []

    def forward(h: Tensor) -> Tensor:
        h = h[keep] if h.dim() == 3 else h  # [B, T, H] -> the kept positions [K, H], row-major
        h = h if index is None else h[index]
        if vocab is not None:
            temp = row_temperatures(temperature, h)
            lp, e = vocab.logprobs(head, h, labels, temp, chunk, entropy)
            e = e if entropy else None
        else:
            lp, e = chunked_token_logprobs(h, head.weight, labels, temperature, chunk=chunk, entropy=entropy)
        ent.append(e)
        return lp[:, None].clone()  # not a view: FSDP2 hooks its pre-backward on this output

    return _with_head(model, head, forward, inputs).logits[:, 0], ent[-1]


def _with_head(model: torch.nn.Module, head: torch.nn.Module, forward: Any, inputs: dict) -> Any:
    """``model(**inputs)`` with ``head.forward`` replaced by ``forward`` for this call only."""
    head.forward = forward
    try:
        return model(**inputs, use_cache=False)
    finally:
        del head.forward  # back to the class's forward


def kept_logits(model: torch.nn.Module, inputs: dict, keep: Tensor) -> Tensor:
    """``[K, V]`` logits of the ``keep`` positions only (``[B, T]`` bool, row-major): the LM head is
    given just those hidden states, inside the model's forward (as :func:`head_logprobs`). This is
    what transformers' ``logits_to_keep`` does with a 2-D bool mask, which its releases before
    ~5.2x do not accept (they index with it as positions and fail); every version runs this."""
    head = lm_head(model)
    if head is None:  # no separate head to narrow: the full logits, then the kept rows
        return model(**inputs, use_cache=False).logits[keep]
    full = head.forward

    def forward(h: Tensor) -> Tensor:
        return full(h[keep] if h.dim() == 3 else h)

    return _with_head(model, head, forward, inputs).logits


def prompt_logprobs(model: torch.nn.Module, ids: Tensor, chunk: int = DEFAULT_CHUNK) -> Tensor:
    """``[L-1]`` fp32 logprob of each token of ``ids`` (``[1, L]``) given its prefix, temperature 1:
    vLLM's ``prompt_logprobs``, chunked when the head is a plain Linear (no ``[L, vocab]`` tensor)."""
    keep = torch.ones_like(ids, dtype=torch.bool)
    keep[:, -1] = False  # the last position predicts nothing in the prompt
    if not can_chunk(model):
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    vocab = lm_head(model).weight.shape[0]
    return head_logprobs(
        model, {"input_ids": ids}, keep, ids[0, 1:], chunk=chunk_rows(chunk, vocab, CHUNK_MIB)
    )[0]


def vocab_parallel(model: torch.nn.Module) -> bool:
    """Whether the model's LM head is vocabulary-parallel (:mod:`hpcrl.models.vocab_parallel`)."""
    head = lm_head(model)
    return getattr(head, "hpcrl_vocab_shard", None) is not None
