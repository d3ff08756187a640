"""Where a micro-batch's tokens sit when the attention kernel takes an explicit mask (sdpa, eager).

Two ideas, both exact rewrites of "run every sample on its own":

* **Rows.** Samples (or units, below) are packed first-fit decreasing into rows with a per-row
  block-causal mask. Attention costs ``rows * width^2`` rather than ``T^2`` for a single packed row
  with a dense block-diagonal mask. Rows exactly as wide as the longest unit leave every unit longer
  than half the width alone in its row (samples of 40-128 tokens: ~9 % padding), so the width is
  chosen per batch (:func:`choose_width`): the cheapest of a few widths from the longest unit up to
  4x it, by the cost model below, among those that pad at most ``MAX_ROW_PADDING``.
* **Shared prefixes.** The n completions of one prompt (a GRPO group) begin with the same tokens.
  Consecutive samples that share a prefix form a *unit*: the prefix is computed once and each
  sample's own tokens attend to it and to themselves, never to a sibling. Hidden states of a causal
  model at a prefix position depend only on the prefix, so every logit is the one the sample would
  get alone, and the prefix's gradient is the sum of its copies' gradients. With 56 prompt tokens
  and 16 completion tokens per sample, a group of 8 costs 184 token slots instead of 576.

Everything here is pure: lengths and token ids in, index arrays out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor


def common_prefix(
    ids: np.ndarray,
    pos: np.ndarray,
    a: tuple[int, int],
    b: tuple[int, int],
    routes: np.ndarray | None = None,
) -> int:
    """Length of the longest common prefix of samples ``a`` and ``b`` (``(start, length)`` in the flat
    arrays), counting a token as shared only if its id AND position id agree, and, with MoE router
    replay (``routes`` [T, layers*k]), its replayed experts too: a shared slot is computed once, with
    one route, so siblings the engine routed differently there keep their own copies."""
    n = min(a[1], b[1])
    sa, sb = slice(a[0], a[0] + n), slice(b[0], b[0] + n)
    same = (ids[sa] == ids[sb]) & (pos[sa] == pos[sb])
    if routes is not None:
        same &= (routes[sa] == routes[sb]).all(axis=1)
    diff = np.flatnonzero(~same)
    return int(diff[0]) if diff.size else n


def shared_prefixes(
    input_ids: np.ndarray,
    position_ids: np.ndarray,
    seq_lens: Sequence[int],
    max_unit_tokens: int,
    key_cost: float = 512.0,
    routes: np.ndarray | None = None,
) -> np.ndarray:
    """``prefix_lens [S]``: 0 for a sample that starts a unit; ``p > 0`` for a sample that joins the
    previous sample's unit, sharing its first ``p`` tokens (the same ``p`` for the whole unit).

    Greedy over consecutive samples, by cost. A unit of ``n`` token slots costs ``n * (key_cost + n)``:
    every slot pays its linear layers (as much as attending to ``key_cost`` keys, see
    :func:`key_cost_of`) plus dense attention over the unit's width. A sample joins only if that
    is cheaper than running it alone, so a group of completions of one prompt becomes a unit, while
    a short system prompt in front of many different samples does not chain them into one wide,
    attention-bound unit. A unit also stays within ``max_unit_tokens`` (one micro-batch)."""
    lens = [int(n) for n in seq_lens]
    starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64) if lens else np.zeros(0, np.int64)
    out = np.zeros(len(lens), dtype=np.int64)

    def cost(n: int) -> float:
        return n * (key_cost + n)

    i = 0
    while i < len(lens):
        head = (int(starts[i]), lens[i])
        p, slots, j = 0, lens[i], i + 1
        while j < len(lens):
            lcp = common_prefix(input_ids, position_ids, head, (int(starts[j]), lens[j]), routes)
            q = lcp if j == i + 1 else min(p, lcp)
            joined = q + sum(n - q for n in lens[i : j + 1])
            if q < 1 or joined > max_unit_tokens or cost(joined) > cost(slots) + cost(lens[j]):
                break
            p, slots, j = q, joined, j + 1
        out[i + 1 : j] = p
        i = j
    return out


def key_cost_of(config: object) -> float:
    """How many attended key positions cost as much as one token's linear layers (per layer): the
    projection and MLP multiply-adds of a token over the ``2 * heads * head_dim`` multiply-adds that
    one query-key pair costs (scores and values). About 4.5x the hidden size for Qwen3-style models."""
    d = int(getattr(config, "hidden_size", 0) or 0)
    if d <= 0:
        return 512.0
    heads = int(getattr(config, "num_attention_heads", 0) or 1)
    head_dim = int(getattr(config, "head_dim", 0) or d // heads)
    kv = int(getattr(config, "num_key_value_heads", 0) or heads)
    ffn = int(getattr(config, "intermediate_size", 0) or 4 * d)
    q_out, kv_out = heads * head_dim, kv * head_dim
    linear = d * (q_out + 2 * kv_out) + q_out * d + 3 * d * ffn
    return linear / (2 * q_out)


# Candidate row widths, as multiples of the longest unit. Wider rows pay more attention per slot
# (key_cost + width) but fit more units side by side; beyond 4x the attention term dominates.
ROW_WIDTH_FACTORS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0)
MAX_ROW_PADDING = 0.05


def rows_needed(sizes: Sequence[int], width: int) -> int:
    """Rows of ``width`` that first-fit decreasing (:func:`place_units`) fills with ``sizes``."""
    return max(place_units(sizes, width), default=0) // width + 1


def choose_width(
    sizes: Sequence[int], key_cost: float, max_padding: float = MAX_ROW_PADDING, max_width: int | None = None
) -> int:
    """Row width for units of ``sizes``: among ``longest * ROW_WIDTH_FACTORS`` (never below the longest
    unit, never above ``max_width`` or all units in one row), the one with the lowest cost
    ``slots * (key_cost + width)`` (every slot pays its linear layers plus attention over the row,
    as in :func:`shared_prefixes`) whose padding is at most ``max_padding``; if none is, the one
    with the least padding. Deterministic: ties go to the narrower width."""
    longest, total = max(sizes), sum(sizes)
    cap = max(longest, min(total, max_width if max_width is not None else total))
    best: tuple[tuple[bool, float, int], int] | None = None
    for f in ROW_WIDTH_FACTORS:
        w = min(cap, math.ceil(longest * f))
        slots = rows_needed(sizes, w) * w
        pad = 1 - total / slots
        within = pad <= max_padding
        key = (not within, slots * (key_cost + w) if within else pad, w)
        if best is None or key < best[0]:
            best = (key, w)
    assert best is not None
    return best[1]


def units_of(prefix_lens: Sequence[int] | None, num_samples: int) -> list[tuple[int, int, int]]:
    """``[(first_sample, end_sample, shared_prefix)]`` from ``prefix_lens`` (None: one unit per sample)."""
    if prefix_lens is None:
        return [(s, s + 1, 0) for s in range(num_samples)]
    units: list[tuple[int, int, int]] = []
    for s, p in enumerate(int(x) for x in prefix_lens):
        if p > 0 and units:
            a, _, _ = units[-1]
            units[-1] = (a, s + 1, p)
        else:
            units.append((s, s + 1, 0))
    return units


def unit_slots(units: list[tuple[int, int, int]], seq_lens: Sequence[int]) -> list[int]:
    """Token slots each unit takes: its shared prefix once plus every member's own tokens."""
    return [p + sum(int(n) - p for n in seq_lens[a:b]) for a, b, p in units]


@dataclass(frozen=True)
class RowLayout:
    """Where each token of a micro-batch sits in a ``[rows, width]`` grid (see the module doc)."""

    rows: int
    width: int
    index: Tensor  # [T] long: slot (row * width + column) of token t; a unit's prefix tokens share slots
    unit: Tensor  # [rows * width] long: unit of each slot; padding slot s holds -1 - s
    member: Tensor  # [rows * width] long: sample owning the slot, -1 for a unit's shared prefix and padding

    @property
    def padding(self) -> int:
        """Slots that hold no token (row tails)."""
        return int((self.unit < 0).sum())

    def grid(self, values: Tensor, fill: int | bool = 0) -> Tensor:
        extra = tuple(values.shape[1:])  # per-token rows (router replay's expert ids) keep their width
        out = values.new_full((self.rows * self.width, *extra), fill)
        out[self.index] = values  # shared slots are written once per member, with equal values
        return out.view(self.rows, self.width, *extra)

    def mask(self, dtype: torch.dtype = torch.bool) -> Tensor:
        """``[rows, 1, width, width]``: key k is visible to query q iff same unit, k <= q, and k is
        in the shared prefix or belongs to q's own sample. A padding slot sees only itself (a fully
        masked query row would give NaN), so padding never mixes into real tokens."""
        unit = self.unit.view(self.rows, self.width)
        member = self.member.view(self.rows, self.width)
        causal = torch.ones(self.width, self.width, dtype=torch.bool, device=unit.device).tril()
        same_unit = unit[:, :, None] == unit[:, None, :]
        visible = (member[:, None, :] == -1) | (member[:, :, None] == member[:, None, :])
        allowed = same_unit & causal & visible
        if dtype == torch.bool:
            return allowed[:, None]
        return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)[:, None]


def place_units(sizes: Sequence[int], width: int) -> list[int]:
    """First-fit decreasing: each unit's first slot in rows of ``width`` (largest units first, each
    into the first row with room; ties keep their order). Deterministic."""
    free: list[int] = []  # free slots left in each row
    start = [0] * len(sizes)
    for u in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        row = next((r for r, f in enumerate(free) if f >= sizes[u]), None)
        if row is None:
            free.append(width)
            row = len(free) - 1
        start[u] = row * width + width - free[row]
        free[row] -= sizes[u]
    return start


def row_layout(
    seq_lens: Tensor,
    prefix_lens: Tensor | None = None,
    key_cost: float | None = None,
    width: int | None = None,
) -> RowLayout:
    """Layout of units (single samples when ``prefix_lens`` is None) into rows, first-fit decreasing
    (:func:`place_units`). Rows are ``width`` wide (at least the longest unit) if given, else as wide
    as :func:`choose_width` says with ``key_cost``, else as wide as the longest unit. Inside a unit:
    the shared prefix, then each member's own tokens in sample order."""
    lens = [int(n) for n in seq_lens.tolist()]
    units = units_of(None if prefix_lens is None else prefix_lens.tolist(), len(lens))
    sizes = unit_slots(units, lens)
    if not sizes:
        width = 1
    elif width is not None:
        width = max(width, max(sizes))
    else:
        width = max(sizes) if key_cost is None else choose_width(sizes, key_cost)
    base = [0] * len(lens)  # slot where each sample's unit starts
    own = [0] * len(lens)  # offset of each sample's own tokens inside its unit
    shared = [0] * len(lens)
    unit_id = [0] * len(lens)
    starts = place_units(sizes, width)
    for u, (a, b, p) in enumerate(units):
        off = p
        for s in range(a, b):
            base[s], own[s], shared[s], unit_id[s] = starts[u], off, p, u
            off += lens[s] - p
    rows = max(starts, default=0) // width + 1
    dev = seq_lens.device
    lens_t = seq_lens.to(torch.long)

    def per_token(v: list[int]) -> Tensor:
        return torch.repeat_interleave(torch.tensor(v, dtype=torch.long, device=dev), lens_t)

    starts = torch.cumsum(lens_t, 0) - lens_t
    within = torch.arange(int(lens_t.sum()), device=dev) - torch.repeat_interleave(starts, lens_t)
    p_t, base_t = per_token(shared), per_token(base)
    in_prefix = within < p_t
    index = torch.where(in_prefix, base_t + within, base_t + per_token(own) + within - p_t)
    unit = -1 - torch.arange(rows * width, device=dev)
    unit[index] = per_token(unit_id)
    member = torch.full((rows * width,), -1, dtype=torch.long, device=dev)
    sample = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens_t)
    # In a unit without sharing, the whole sample acts as its "prefix" (member -1): same mask.
    owned = ~in_prefix & (p_t > 0)
    member[index[owned]] = sample[owned]
    return RowLayout(rows=rows, width=width, index=index, unit=unit, member=member)
