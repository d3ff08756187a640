"""Advantages of the reward-based algorithms ([orchestrator.algo] type grpo, max_rl, rae), as pure
numpy functions over one comparison group (one task's G rollouts, or one agent's traces of them).

grpo (prime-rl's default; Dr. GRPO):
    s_i = r_i - mean(r) * penalty_i          penalty_i = w_out * out_i / max(out)
                                                        + w_in * in_i / max(in) + w_turns * turns_i / max(turns)
    A_i = s_i - mean(s)                      (/ (std(s) + eps) with hpcrl's std_normalize: GRPO proper)
  The length penalty (prime-rl's linear one, off by default) scales with the group's pass rate
  mean(r), so it only bites once the group succeeds, and each quantity is relative to the group's
  longest (each max is at least 1). Without it, A_i = r_i - mean(r).
max_rl (arXiv:2602.02710):
    A_i = (r_i - mean(r)) / mean(r), or 0 for every rollout when mean(r) <= 0.
rae (SPIRAL, arXiv:2506.24119), trace after trace:
    A_k = r_k - b[agent_k];  then  b[agent_k] <- decay * b[agent_k] + (1 - decay) * r_k    (b starts at 0)

- `std` is the population std (ddof=0).
- hpcrl's reward clipping (`reward_clip`) bounds every reward into [-c, c] first.
- A group is "zero-advantage" when every advantage is 0 (|A| <= eps): it carries no learning signal
  (prime-rl drops such traces too). `zero_advantage="drop"` removes such groups; `"keep"` keeps them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

ZeroAdv = Literal["keep", "drop"]
GroupKind = Literal["grpo", "max_rl"]


@dataclass(frozen=True)
class LengthPenalty:
    """prime-rl's linear length penalty ([orchestrator.algo.length_penalty], same field names)."""

    num_output_tokens_weight: float = 0.25
    num_input_tokens_weight: float = 0.1
    num_turns_weight: float = 0.1


@dataclass(frozen=True)
class AdvantageConfig:
    """How one group's rewards become advantages: the algorithm's kind, its length penalty, and hpcrl's
    `[orchestrator.advantage]` knobs (std_normalize, reward_clip, zero_advantage)."""

    kind: GroupKind = "grpo"
    std_normalize: bool = False
    zero_advantage: ZeroAdv = "drop"
    eps: float = 1e-6
    reward_clip: float | None = None  # clip rewards into [-c, c] before anything else (None: off)
    length_penalty: LengthPenalty | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("grpo", "max_rl"):
            raise ValueError(f"kind={self.kind!r} is not one of grpo, max_rl")
        if self.zero_advantage not in ("keep", "drop"):
            raise ValueError(f"zero_advantage={self.zero_advantage!r} is not one of keep, drop")
        if self.eps <= 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")
        if self.reward_clip is not None and self.reward_clip <= 0:
            raise ValueError(f"reward_clip must be > 0, got {self.reward_clip}")


@dataclass(frozen=True)
class GroupSizes:
    """Per rollout (or trace) of a group: completion tokens, tokens conditioned on but not sampled
    (prompt, env responses), and model turns: what the length penalty measures."""

    output: Sequence[float]
    input: Sequence[float]
    turns: Sequence[float]


def clip_rewards(rewards: Sequence[float] | np.ndarray, reward_clip: float | None) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    return r if reward_clip is None else np.clip(r, -reward_clip, reward_clip)


def _relative(x: Sequence[float]) -> np.ndarray:
    v = np.asarray(x, dtype=np.float64)
    return v / max(float(v.max()), 1.0)


def length_penalty_fraction(sizes: GroupSizes, lp: LengthPenalty) -> np.ndarray:
    """sum of weight x quantity / the group's max of it (each max at least 1), per rollout."""
    return (
        lp.num_output_tokens_weight * _relative(sizes.output)
        + lp.num_input_tokens_weight * _relative(sizes.input)
        + lp.num_turns_weight * _relative(sizes.turns)
    )


def grpo_advantages(
    rewards: Sequence[float] | np.ndarray,
    sizes: GroupSizes | None = None,
    *,
    length_penalty: LengthPenalty | None = None,
    std_normalize: bool = False,
    eps: float = 1e-6,
) -> np.ndarray:
    """GRPO advantages of one group (float32[G]); see the module docstring for the formula."""
    r = _check(rewards)
    if length_penalty is not None:
        if sizes is None:
            raise ValueError("length_penalty needs the group's sizes (output, input tokens, turns)")
        r = r - r.mean() * length_penalty_fraction(sizes, length_penalty)
    adv = r - r.mean()
    if std_normalize:
        adv = adv / (r.std() + eps)
    return adv.astype(np.float32)


def max_rl_advantages(rewards: Sequence[float] | np.ndarray) -> np.ndarray:
    """MaxRL advantages of one group (float32[G]): (r - mean) / mean, all 0 when mean <= 0."""
    r = _check(rewards)
    mean = r.mean()
    if mean <= 0:
        return np.zeros(r.shape, dtype=np.float32)
    return ((r - mean) / mean).astype(np.float32)


def rae_advantages(
    rewards: Sequence[float], agents: Sequence[str], baselines: Mapping[str, float], decay: float
) -> tuple[np.ndarray, dict[str, float]]:
    """RAE over traces in order: (advantages float32[K], the updated baselines). Each trace is scored
    against its agent's baseline before its own reward moves it (SPIRAL's unbiased order)."""
    if len(rewards) != len(agents):
        raise ValueError(f"{len(rewards)} rewards for {len(agents)} agents")
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"decay must be in [0, 1), got {decay}")
    out = dict(baselines)
    adv = np.zeros(len(rewards), dtype=np.float64)
    for k, (r, agent) in enumerate(zip(rewards, agents)):
        b = out.get(agent, 0.0)
        adv[k] = r - b
        out[agent] = decay * b + (1.0 - decay) * float(r)
    return adv.astype(np.float32), out


def group_advantages(
    rewards: Sequence[float] | np.ndarray, sizes: GroupSizes | None, config: AdvantageConfig
) -> np.ndarray:
    """One group's advantages for a group-relative kind (grpo, max_rl), rewards clipped first."""
    r = clip_rewards(rewards, config.reward_clip)
    if config.kind == "max_rl":
        return max_rl_advantages(r)
    return grpo_advantages(
        r, sizes, length_penalty=config.length_penalty, std_normalize=config.std_normalize, eps=config.eps
    )


def is_zero_advantage(advantages: Sequence[float] | np.ndarray, eps: float = 1e-6) -> bool:
    a = np.asarray(advantages, dtype=np.float64)
    return a.size == 0 or bool(np.all(np.abs(a) <= eps))


def compute_advantages(
    groups: Sequence[Sequence[float] | np.ndarray],
    sizes: Sequence[GroupSizes] | None = None,
    config: AdvantageConfig = AdvantageConfig(),
) -> tuple[list[np.ndarray], np.ndarray]:
    """Advantages for many groups (sizes may differ, e.g. after errored rollouts).

    Returns (advantages per group, keep: bool[num_groups]). A dropped zero-advantage group still
    gets its advantage array (zeros) so indices stay aligned; callers skip it using `keep`.
    """
    advs: list[np.ndarray] = []
    keep = np.ones(len(groups), dtype=bool)
    for g, rewards in enumerate(groups):
        adv = group_advantages(rewards, None if sizes is None else sizes[g], config)
        if is_zero_advantage(adv, config.eps):
            adv = np.zeros_like(adv)
            keep[g] = config.zero_advantage == "keep"
        advs.append(adv)
    return advs, keep


def _check(rewards: Sequence[float] | np.ndarray) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1 or r.size == 0:
        raise ValueError(f"rewards must be a non-empty 1-D array, got shape {r.shape}")
    return r
