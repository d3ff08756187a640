"""The hf engine's running decode batch: KV cache, attention mask and positions in preallocated slabs.

Rows are slots 0..B-1 of buffers shaped [max_rows, heads, capacity, head_dim] (one K and one V per
layer) plus a bool mask [max_rows, capacity]. Every row is aligned on the right: its tokens end at
column `end`, and the window [start, end) covers the longest row. So

- a decode step writes one column in place (no torch.cat of the whole cache every step, which was
  half of the decode time for a small model) and passes the mask as a ready 4D view, which skips
  transformers' per-step mask construction;
- admitting rows copies only the new rows into free slots (the running rows move only when a prompt
  is longer than the window, or when the buffer grows, amortised by doubling);
- retiring rows moves the last rows into the holes (swap-remove): cost proportional to the retired
  rows, not to the batch. Callers must follow the returned order.

Masked (padding) columns hold finite values (zeros or an older row's keys), so their softmax weight
is exactly 0 and a row's result does not depend on its neighbours beyond float reassociation.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class SlabLayer(DynamicLayer):
    """A cache layer whose keys/values are views of a slab; `update` writes the new column in place."""

    def __init__(self, batch: DecodeBatch, index: int):
        super().__init__()
        self.batch, self.index = batch, index
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, e = self.batch.size, self.batch.start, self.batch.end
        q = key_states.shape[-2]
        k, v = self.batch.k[self.index], self.batch.v[self.index]
        k[:b, :, e : e + q] = key_states
        v[:b, :, e : e + q] = value_states
        return k[:b, :, s : e + q], v[:b, :, s : e + q]

    def get_seq_length(self) -> int:
        return self.batch.end - self.batch.start

    def get_max_length(self) -> int:
        return -1


class DecodeBatch:
    """Running rows (any objects, `rows[i]` owns slot i) and their KV/mask/position/logits state."""

    def __init__(self, model: Any, max_rows: int, device: torch.device, min_capacity: int = 64):
        self.model, self.max_rows, self.device, self.min_capacity = model, max_rows, device, min_capacity
        self.rows: list[Any] = []
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.mask = torch.zeros(0, 0, dtype=torch.bool, device=device)
        self.pos = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.first: list[int] = []  # first column of each row's own tokens
        self.start = self.end = 0
        self.logits: torch.Tensor | None = None  # [B, V] logits for each row's next token
        self.cache = DynamicCache(config=model.config)

    @property
    def size(self) -> int:
        return len(self.rows)

    @property
    def capacity(self) -> int:
        return self.mask.shape[1]

    # -- layout ----------------------------------------------------------------------------------------
    def _relayout(self, end: int, need: int) -> None:
        """Move the window so that it ends at column `end`, into buffers of at least `need` columns."""
        b, s, e = self.size, self.start, self.end
        width = e - s
        cap = max(self.min_capacity, need, 2 * self.capacity if need > self.capacity else self.capacity)
        old_k, old_v, old_mask = self.k, self.v, self.mask
        if cap != self.capacity or self.mask.shape[0] == 0:
            shape = [self.max_rows, *self.k[0].shape[1:2], cap, self.k[0].shape[3]]
            self.k = [torch.zeros(shape, dtype=t.dtype, device=self.device) for t in old_k]
            self.v = [torch.zeros(shape, dtype=t.dtype, device=self.device) for t in old_v]
            self.mask = torch.zeros(self.max_rows, cap, dtype=torch.bool, device=self.device)
        if b:
            for new, old in zip(self.k + self.v, old_k + old_v):
                new[:b, :, end - width : end] = old[:b, :, s:e].clone()
            win = old_mask[:b, s:e].clone()
            self.mask[:b].zero_()
            self.mask[:b, end - width : end] = win
            shift = end - e
            self.first = [f + shift for f in self.first]
        self.start, self.end = (end - width if b else end), end

    def add(
        self,
        rows: list[Any],
        kv: Any,
        idx: torch.Tensor,
        mask: torch.Tensor,
        pos: torch.Tensor,
        logits: torch.Tensor,
    ) -> None:
        """Append prefilled rows: row j's cache is row idx[j] of the prefill cache `kv` (left-padded
        to width W by `mask`), so samples of one prompt share its prefill."""
        n, w = len(rows), mask.shape[1]
        assert self.size + n <= self.max_rows
        if not self.k:  # buffers take the model's cache shapes from the first prefill
            self.k = [layer.keys[:1, :, :0] for layer in kv.layers]
            self.v = [layer.values[:1, :, :0] for layer in kv.layers]
            self.cache.layers = [SlabLayer(self, i) for i in range(len(kv.layers))]
            self.cache.layer_class_to_replicate = None
        if self.size == 0 or w > self.end or self.end + 1 > self.capacity:
            end = max(w, self.end if self.size else 0)
            self._relayout(end, end + max(self.min_capacity, end // 2))
        b, e = self.size, self.end
        for layer, k, v in zip(kv.layers, self.k, self.v):
            k[b : b + n, :, : e - w].zero_()  # stale columns must stay finite (0 * NaN would leak)
            v[b : b + n, :, : e - w].zero_()
            k[b : b + n, :, e - w : e] = layer.keys[idx]
            v[b : b + n, :, e - w : e] = layer.values[idx]
        self.mask[b : b + n].zero_()
        self.mask[b : b + n, e - w : e] = mask[idx].bool()
        self.pos[b : b + n] = pos[idx]
        lens = mask[idx].sum(1).tolist()
        self.first += [e - int(x) for x in lens]
        self.start = min(self.first)
        new_logits = logits[idx]
        self.logits = new_logits if self.logits is None or b == 0 else torch.cat([self.logits, new_logits])
        self.rows = self.rows + rows

    def remove(self, drop: list[int]) -> list[int]:
        """Retire the rows at positions `drop`; return `order`: new row i is old row order[i]."""
        b = self.size
        dropped = set(drop)
        keep_n = b - len(dropped)
        holes = [i for i in sorted(dropped) if i < keep_n]
        movers = [j for j in range(keep_n, b) if j not in dropped]
        order = list(range(keep_n))
        for h, m in zip(holes, movers):
            order[h] = m
        if holes:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            s, e = self.start, self.end
            for t in self.k + self.v:
                t[dst, :, s:e] = t[src, :, s:e]
            self.mask[dst, s:e] = self.mask[src, s:e]
            self.pos[dst] = self.pos[src]
        self.rows = [self.rows[i] for i in order]
        self.first = [self.first[i] for i in order]
        if keep_n == 0:
            self.logits, self.start, self.end = None, 0, 0
        else:
            assert self.logits is not None
            self.logits = self.logits[torch.tensor(order, device=self.device)] if keep_n != b else self.logits
            self.start = min(self.first)  # columns that are padding for every row drop out of the window
        return order

    def clear(self) -> None:
        self.rows, self.first, self.logits, self.start, self.end = [], [], None, 0, 0

    # -- one decode forward ----------------------------------------------------------------------------
    def step(self, tokens: torch.Tensor) -> None:
        """Feed each row's sampled token; afterwards `logits` holds the next token's logits."""
        b = self.size
        if self.end + 1 > self.capacity:
            width = self.end - self.start
            self._relayout(width, width + max(self.min_capacity, width))
        e = self.end
        self.mask[:b, e] = True
        attn = self.mask[:b, None, None, self.start : e + 1]  # 4D: transformers uses it as is
        out = self.model(
            input_ids=tokens.view(b, 1).to(self.device),
            attention_mask=attn,
            position_ids=self.pos[:b, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.end = e + 1
        self.pos[:b] += 1
        self.logits = out.logits[:, -1].float()
