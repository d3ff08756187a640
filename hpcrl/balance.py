"""Token-balanced assignment of samples to data-parallel ranks, shared by RL (the orchestrator packs
rollouts per trainer rank) and SFT (the trainer shards its rows): neither role imports the other.

Longest first into the least-loaded rank keeps the slowest rank - the one every other rank waits for -
close to the mean.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def assign_to_ranks(lengths: Sequence[int], num_ranks: int) -> list[list[int]]:
    """Greedy longest-first into the least-loaded rank. Returns sample indices per rank, each in
    ascending order."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    heap = [(0, r) for r in range(num_ranks)]  # (tokens, rank): ties go to the lower rank
    out: list[list[int]] = [[] for _ in range(num_ranks)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + int(lengths[i]), r))
    return [sorted(idx) for idx in out]
