"""Group-relative advantages (GRPO family), as pure numpy functions.

For one group of G rollouts of the same task with rewards r_i and completion lengths L_i:

    r_i = clip(r_i, -reward_clip, reward_clip)   (when reward_clip is set)
    A_i = (r_i - mean(r)) / (std(r) + eps if std_normalize else 1)  -  length_penalty * (L_i - mean(L)) / max(mean(L), 1)

- `std(r)` is the population std (ddof=0), as in GRPO.
- The length term pushes towards shorter completions among the group without changing the
  group's total advantage (it sums to zero); it is relative (divided by the mean length) so
  one coefficient means the same on short and long tasks. With length_penalty=0 it vanishes.
- A group is "zero-advantage" when all its rewards are equal (max - min <= eps): it carries no
  learning signal about the reward. `zero_advantage="drop"` removes such groups; `"keep"` keeps them
  (their advantages are then 0, or the length term alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

ZeroAdv = Literal["keep", "drop"]


@dataclass(frozen=True)
class AdvantageConfig:
    """Field names match the `[orchestrator.advantage]` config section, so
    `AdvantageConfig(**msgspec.structs.asdict(cfg.orchestrator.advantage))` works."""

    std_normalize: bool = False
    length_penalty: float = 0.0
    zero_advantage: ZeroAdv = "drop"
    eps: float = 1e-6
    reward_clip: float | None = None  # clip rewards into [-c, c] before anything else (None: off)

    def __post_init__(self) -> None:
        if self.zero_advantage not in ("keep", "drop"):
            raise ValueError(f"zero_advantage={self.zero_advantage!r} is not one of keep, drop")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.reward_clip is not None and self.reward_clip <= 0:
            raise ValueError(f"reward_clip must be > 0, got {self.reward_clip}")
        if self.length_penalty < 0:
            raise ValueError(f"length_penalty must be >= 0, got {self.length_penalty}")


def is_zero_advantage_group(rewards: np.ndarray, eps: float = 1e-6) -> bool:
    r = np.asarray(rewards, dtype=np.float64)
    return r.size == 0 or float(r.max() - r.min()) <= eps


def group_advantages(
    rewards: Sequence[float] | np.ndarray,
    lengths: Sequence[int] | np.ndarray | None = None,
    *,
    std_normalize: bool = False,
    eps: float = 1e-6,
    length_penalty: float = 0.0,
) -> np.ndarray:
    """Advantages of one group (float32[G]); see the module docstring for the formula."""
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-D array, got shape {r.shape}")
    adv = r - r.mean()
    if std_normalize:
        adv = adv / (r.std() + eps)
    if length_penalty:
        if lengths is None:
            raise ValueError("length_penalty needs the completion lengths")
        lens = np.asarray(lengths, dtype=np.float64)
        if lens.shape != r.shape:
            raise ValueError(f"lengths shape {lens.shape} != rewards shape {r.shape}")
        mean_len = lens.mean()
        adv = adv - length_penalty * (lens - mean_len) / max(mean_len, 1.0)
    return adv.astype(np.float32)


def compute_advantages(
    groups: Sequence[Sequence[float] | np.ndarray],
    lengths: Sequence[Sequence[int] | np.ndarray] | None = None,
    config: AdvantageConfig = AdvantageConfig(),
) -> tuple[list[np.ndarray], np.ndarray]:
    """Advantages for many groups (sizes may differ, e.g. after errored rollouts).

    Returns (advantages per group, keep: bool[num_groups]). Dropped groups still get an
    advantage array (zeros) so indices stay aligned; callers skip them using `keep`.
    """
    advs: list[np.ndarray] = []
    keep = np.ones(len(groups), dtype=bool)
    for g, rewards in enumerate(groups):
        r = np.asarray(rewards, dtype=np.float64)
        if config.reward_clip is not None:  # seed 004's reward clipping: an outlier reward is bounded
            r = np.clip(r, -config.reward_clip, config.reward_clip)
        zero = is_zero_advantage_group(r, config.eps)
        if zero and config.zero_advantage == "drop":
            keep[g] = False
            advs.append(np.zeros(r.shape, dtype=np.float32))
            continue
        advs.append(
            group_advantages(
                r,
                None if lengths is None else lengths[g],
                std_normalize=config.std_normalize,
                eps=config.eps,
                length_penalty=config.length_penalty,
            )
        )
    return advs, keep
