"""The embedded engine's KV capacity (issue 53): a budget of cached tokens shared by the running
sequences, so that a small `inference.kv_cache_tokens` really queues and preempts, as vLLM's block
manager does.

- A waiting sequence is admitted (first come, first served) only while its prompt (plus the tokens it
  already sampled, if it was preempted) fits in what the running ones leave free.
- Each decode step adds one token per running row; when the rows would no longer fit, the youngest
  are preempted (their cache dropped, back to the head of the queue, resumed later by recomputing
  prompt + tokens so far: vLLM's recompute preemption) and counted (`vllm:num_preemptions`).

Pure functions over token counts; hpcrl.inference.engine applies them."""

from __future__ import annotations

from collections.abc import Sequence

from hpcrl.errors import ConfigError


def capacity(kv_cache_tokens: int | None, max_batch_size: int, max_model_len: int) -> int:
    """The budget in tokens: `kv_cache_tokens`, else room for max_batch_size full contexts (no
    preemption possible: the engine before issue 53). Refused below one full context (a lone
    sequence must always fit, as vLLM refuses a max_model_len its cache cannot hold)."""
    if kv_cache_tokens is None:
        return max_batch_size * max_model_len
    if kv_cache_tokens < max_model_len:
        raise ConfigError(
            "inference.kv_cache_tokens",
            f"{kv_cache_tokens} cannot hold one sequence of max_model_len = {max_model_len} tokens",
        )
    return int(kv_cache_tokens)


def admissible(waiting: Sequence[int], used: int, cap: int, running: int = 0) -> int:
    """How many of the waiting sequences (their token counts, queue order) to admit now: the longest
    head of the queue that fits with room for one more token per row (`running` rows now), so an
    admission never forces a preemption at the next step; the first that does not fit blocks the
    rest (FCFS)."""
    n = 0
    for need in waiting:
        if used + need + running + n + 1 > cap:
            break
        used += need
        n += 1
    return n


def victims(lengths: Sequence[int], ages: Sequence[tuple[float, int]], cap: int) -> list[int]:
    """Rows to preempt (youngest first by `ages`, larger = younger) until the rest fit in `cap`;
    the oldest row always stays (it fits alone: capacity >= max_model_len)."""
    total = sum(lengths)
    out: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: ages[i], reverse=True):
        if total <= cap or len(out) == len(lengths) - 1:
            break
        out.append(i)
        total -= lengths[i]
    return out
