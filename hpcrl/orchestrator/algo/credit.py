"""Credit assignment: a finished group's rollouts (or, multi-agent, their traces) -> advantages.

echo's rl part is grpo's; its cross-entropy weights are set here too (hpcrl.orchestrator.algo.echo).

A comparison group is one agent's traces across the task's rollouts: trace j of every usable
rollout (a single-agent rollout is one trace, j = 0). grpo and max_rl compare the members of a
comparison group (hpcrl.orchestrator.advantages); rae compares each trace with its agent's running
baseline instead, keyed `<env>/<trace index>` (prime-rl's per (env, agent)): verifiers lists an
episode's trained traces in its agents' order, so the index names the agent. The baselines are part
of the orchestrator's checkpointed state (OrchestratorState.algo), so a resume continues them
exactly (prime-rl re-warms them from 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hpcrl.config.sections.algo import AlgoConfig
from hpcrl.orchestrator.advantages import (
    AdvantageConfig,
    GroupSizes,
    LengthPenalty,
    clip_rewards,
    group_advantages,
    is_zero_advantage,
    rae_advantages,
)
from hpcrl.orchestrator.algo.echo import Echo
from hpcrl.orchestrator.state import GroupRecord, RolloutRecord

STATE_KEY = "rae_baselines"


@dataclass(frozen=True)
class Member:
    """One trace of one rollout in its comparison group."""

    index: int  # the rollout's index in its group
    reward: float
    output: int  # sampled tokens
    input: int  # tokens conditioned on and not sampled (prompt, env responses)
    turns: int  # model turns (runs of sampled tokens)


def trace_count(r: RolloutRecord) -> int:
    return len(r.trace_rewards) if r.trace_rewards else 1


def member(r: RolloutRecord, j: int) -> Member:
    """Trace j of rollout r, measured on its pieces (the sequences that are trained)."""
    pieces = [p for p in r.pieces if p.trace == j] if r.trace_rewards else r.pieces
    masks = [np.asarray(p.loss_mask, dtype=bool) for p in pieces]
    out = sum(int(m.sum()) for m in masks)
    runs = sum(
        int(np.count_nonzero(np.diff(np.concatenate([[False], m]).astype(np.int8)) == 1)) for m in masks
    )
    reward = r.trace_rewards[j] if r.trace_rewards else r.reward
    return Member(r.index, float(reward), out, sum(len(m) for m in masks) - out, runs)


def comparison_groups(ok: Sequence[RolloutRecord]) -> dict[int, list[Member]]:
    """{trace j: trace j of every usable rollout that has one}, rollouts in group order."""
    out: dict[int, list[Member]] = {}
    for r in sorted(ok, key=lambda r: r.index):
        for j in range(trace_count(r)):
            out.setdefault(j, []).append(member(r, j))
    return out


class Credit:
    """The credit assignment of one run's algorithm; `assign` sets a group's advantages."""

    def __init__(self, algo: AlgoConfig, advantage: Any, per_env: dict[str, AlgoConfig] | None = None):
        """`advantage`: the [orchestrator.advantage] section (hpcrl's knobs of the reward-based types);
        `per_env`: {env name: its own algorithm} (prime-rl's per-source algo), the others run `algo`."""
        self.own = {env: Credit(a, advantage) for env, a in (per_env or {}).items()}
        self.type, self.action_loss, self.decay = algo.type, algo.action_loss, algo.decay
        lp = algo.length_penalty
        self.config = AdvantageConfig(
            kind="max_rl" if algo.type == "max_rl" else "grpo",
            std_normalize=advantage.std_normalize,
            zero_advantage=advantage.zero_advantage,
            reward_clip=advantage.reward_clip,
            length_penalty=None
            if lp is None
            else LengthPenalty(lp.num_output_tokens_weight, lp.num_input_tokens_weight, lp.num_turns_weight),
        )
        self.baselines: dict[str, float] = {}  # rae
        self.echo = Echo(algo) if algo.type == "echo" else None  # its cross entropy's token weights

    # -- checkpointed state (OrchestratorState.algo) --
    def state_dict(self) -> dict[str, Any]:
        """rae's baselines, of the run's algo and of every env's own (keys `<env>/<trace>`: disjoint)."""
        credits = [self, *self.own.values()]
        baselines = {k: v for c in credits if c.type == "rae" for k, v in c.baselines.items()}
        return {STATE_KEY: baselines} if any(c.type == "rae" for c in credits) else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for c in [self, *self.own.values()]:
            c.baselines = {str(k): float(v) for k, v in state.get(STATE_KEY, {}).items()}

    def for_env(self, env: str) -> Credit:
        """The credit of `env`: its own algorithm's, else the run's."""
        return self.own.get(env, self)

    # -- one group --
    def assign(self, group: GroupRecord, ok: Sequence[RolloutRecord]) -> bool:
        """Set `group.advantages` (one per rollout; errored ones 0) and, for multi-agent rollouts,
        `group.trace_advantages`. False: the group carries no signal and zero_advantage = drop (its
        advantages are then all 0, the last-resort filler of a starved batch)."""
        if group.env in self.own:
            return self.own[group.env].assign(group, ok)
        group.trace_advantages = None
        if self.echo is not None:
            self.echo.weigh(ok)
        if self.action_loss == "ce":  # sft: cross entropy on every usable completion, no credit
            group.advantages = [0.0 if r.errored else 1.0 for r in group.rollouts]
            return True
        if self.action_loss == "ref_kl":  # opd / opsd: the signal is per token (reference logprobs)
            group.advantages = [0.0] * len(group.rollouts)
            return True
        per = self.advantages_by_trace(group.env, ok)
        if is_zero_advantage(list(per.values()), self.config.eps):
            group.advantages = [0.0] * len(group.rollouts)
            if self.config.zero_advantage == "drop" and self.echo is not None:
                return self.echo.rl_pruned(ok)  # its cross entropy still trains (prime-rl)
            return self.config.zero_advantage == "keep"
        if any(r.trace_rewards for r in ok):
            usable = {r.index for r in ok}
            group.trace_advantages = [
                [per[(r.index, j)] for j in range(trace_count(r))] if r.index in usable else []
                for r in group.rollouts
            ]
            group.advantages = [float(np.mean(t)) if t else 0.0 for t in group.trace_advantages]
        else:
            group.advantages = [per.get((r.index, 0), 0.0) for r in group.rollouts]
        return True

    def advantages_by_trace(self, env: str, ok: Sequence[RolloutRecord]) -> dict[tuple[int, int], float]:
        """{(rollout index, trace j): advantage} over the usable rollouts (rae: moves the baselines)."""
        per: dict[tuple[int, int], float] = {}
        for j, members in sorted(comparison_groups(ok).items()):
            rewards = [m.reward for m in members]
            if self.type == "rae":
                clipped = clip_rewards(rewards, self.config.reward_clip).tolist()
                adv, self.baselines = rae_advantages(
                    clipped, [f"{env}/{j}"] * len(members), self.baselines, self.decay
                )
            else:
                sizes = GroupSizes(
                    output=[m.output for m in members],
                    input=[m.input for m in members],
                    turns=[m.turns for m in members],
                )
                adv = group_advantages(rewards, sizes, self.config)
            for m, a in zip(members, adv):
                per[(m.index, j)] = float(a)
        return per
