"""Which tasks to roll out next, and which finished groups/samples to train on.

Everything here is deterministic in the seed and checkpointable as a plain JSON-able dict
(`state_dict()` / `load_state_dict()`), so a resumed run continues the exact same task stream:

- `TaskSampler`: one per environment; walks a seeded permutation of the task indices, a new
  permutation per epoch (seeded by seed + epoch). State = (epoch, cursor).
- `EnvMixer`: decides which environment the next task comes from, following `env_ratios` as
  closely as possible (largest deficit first; seeded tie order), so a batch of 10 at 0.6/0.4 is
  exactly 6/4 rather than binomially noisy. State = per-env counts.
- `DifficultyFilter`: online difficulty filtering on a group's mean reward (hosted `[buffer]`).
- `is_stale`: the strict per-sample off-policy bound.
- `Buffer`: the above together, plus tasks in flight: a task handed out but not yet `complete`d
  when a checkpoint is taken is re-issued first after resume, so no prompt is skipped or repeated.

Random draws come from `random.Random(<string seed>)` per decision (counter-based), not from a
long-lived generator, so the state is a few integers and draws are stable across Python/numpy
versions.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class BufferConfig:
    online_difficulty_filtering: bool = False
    easy_threshold: float = 0.8  # group mean reward >= this: easy
    hard_threshold: float = 0.2  # group mean reward <= this: hard
    easy_fraction: float = 0.0  # probability of keeping an easy group
    hard_fraction: float = 0.0  # probability of keeping a hard group
    env_ratios: tuple[float, ...] | None = None  # None: equal
    oversampling_factor: float = 1.0
    max_off_policy_steps: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.hard_threshold < self.easy_threshold:
            raise ValueError(
                f"buffer.hard_threshold ({self.hard_threshold}) must be < buffer.easy_threshold "
                f"({self.easy_threshold})"
            )
        for name in ("easy_fraction", "hard_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"buffer.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.oversampling_factor < 1.0:
            raise ValueError(f"oversampling_factor must be >= 1, got {self.oversampling_factor}")
        if self.max_off_policy_steps < 0:
            raise ValueError(f"max_off_policy_steps must be >= 0, got {self.max_off_policy_steps}")


def _uniform(*key: object) -> float:
    """A reproducible uniform draw in [0, 1) for a decision identified by `key`."""
    return random.Random("/".join(map(str, key))).random()


class TaskSampler:
    """Epoch-wise shuffled walk over `num_tasks` task indices."""

    def __init__(self, num_tasks: int, seed: int, shuffle: bool = True) -> None:
        if num_tasks <= 0:
            raise ValueError(f"a task sampler needs at least one task, got {num_tasks}")
        self.num_tasks, self.seed, self.shuffle = num_tasks, seed, shuffle
        self.epoch, self.cursor = 0, 0
        self._order: list[int] | None = None

    def order(self, epoch: int) -> list[int]:
        order = list(range(self.num_tasks))
        if self.shuffle:
            random.Random(f"tasks/{self.seed}/{epoch}").shuffle(order)
        return order

    def next(self) -> tuple[int, int]:
        """(task index, epoch) of the next task."""
        if self.cursor >= self.num_tasks:
            self.epoch, self.cursor, self._order = self.epoch + 1, 0, None
        if self._order is None:
            self._order = self.order(self.epoch)
        index = self._order[self.cursor]
        self.cursor += 1
        return index, self.epoch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "num_tasks": self.num_tasks}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state["num_tasks"] != self.num_tasks:
            # A different task list would make the cursor point at other prompts: refuse.
            raise ValueError(
                f"checkpointed sampler had {state['num_tasks']} tasks, this run has {self.num_tasks}"
            )
        self.epoch, self.cursor, self._order = int(state["epoch"]), int(state["cursor"]), None


class EnvMixer:
    """Deterministic env choice following ratios (largest deficit first)."""

    def __init__(self, ratios: Sequence[float], seed: int) -> None:
        r = np.asarray(ratios, dtype=np.float64)
        if r.ndim != 1 or r.size == 0 or (r < 0).any() or r.sum() <= 0:
            raise ValueError(f"env_ratios must be non-negative with a positive sum, got {list(ratios)}")
        self.ratios = r / r.sum()
        tie = list(range(r.size))
        random.Random(f"mixer/{seed}").shuffle(tie)
        self._tie_rank = np.empty(r.size, dtype=np.int64)
        self._tie_rank[tie] = np.arange(r.size)
        self.counts = np.zeros(r.size, dtype=np.int64)

    def next(self) -> int:
        deficit = self.ratios * (self.counts.sum() + 1) - self.counts
        best = np.flatnonzero(np.isclose(deficit, deficit.max(), rtol=0, atol=1e-9) & (self.ratios > 0))
        choice = int(best[np.argmin(self._tie_rank[best])])
        self.counts[choice] += 1
        return choice

    def state_dict(self) -> dict[str, list[int]]:
        return {"counts": self.counts.tolist()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        counts = np.asarray(state["counts"], dtype=np.int64)
        if counts.shape != self.counts.shape:
            raise ValueError(f"checkpointed mixer had {counts.size} envs, this run has {self.counts.size}")
        self.counts = counts


class DifficultyFilter:
    """Keep/drop a finished group from its mean reward: easy (>= easy_threshold) groups are kept
    with probability easy_fraction, hard (<= hard_threshold) ones with hard_fraction, others always."""

    def __init__(self, config: BufferConfig) -> None:
        self.config = config
        self.decisions = 0

    def classify(self, mean_reward: float) -> str:
        if mean_reward >= self.config.easy_threshold:
            return "easy"
        if mean_reward <= self.config.hard_threshold:
            return "hard"
        return "normal"

    def keep(self, mean_reward: float) -> tuple[bool, str]:
        kind = self.classify(mean_reward)
        if not self.config.online_difficulty_filtering or kind == "normal":
            return True, kind
        fraction = self.config.easy_fraction if kind == "easy" else self.config.hard_fraction
        u = _uniform("filter", self.config.seed, self.decisions)
        self.decisions += 1
        return u < fraction, kind


def is_stale(oldest_policy_step: int, current_step: int, max_off_policy_steps: int) -> bool:
    """Strict per-sample bound: stale when the oldest token's policy is more than
    max_off_policy_steps behind the step being trained."""
    return oldest_policy_step < current_step - max_off_policy_steps


@dataclass(frozen=True)
class TaskRef:
    """A handed-out task: env name, index into env.tasks(split), epoch it was drawn in."""

    env: str
    index: int
    epoch: int


_COUNTERS = (
    "tasks_issued",
    "groups_seen",
    "groups_easy",
    "groups_hard",
    "groups_dropped_easy",
    "groups_dropped_hard",
    "samples_checked",
    "samples_stale",
)


class Buffer:
    """Task stream + filters for the orchestrator. `env_sizes` maps env name -> number of train
    tasks, in config order (the order env_ratios refers to)."""

    def __init__(self, env_sizes: Mapping[str, int], config: BufferConfig = BufferConfig()) -> None:
        self.config = config
        self.env_names = list(env_sizes)
        ratios = config.env_ratios if config.env_ratios is not None else [1.0] * len(self.env_names)
        if len(ratios) != len(self.env_names):
            raise ValueError(
                f"buffer.env_ratios has {len(ratios)} entries but there are {len(self.env_names)} "
                f"train environments ({', '.join(self.env_names)})"
            )
        self.mixer = EnvMixer(ratios, config.seed)
        self.samplers = {
            name: TaskSampler(n, seed=config.seed + 7919 * i)  # distinct streams per env
            for i, (name, n) in enumerate(env_sizes.items())
            if ratios[i] > 0
        }
        self.filter = DifficultyFilter(config)
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self._pending: dict[TaskRef, None] = {}  # insertion-ordered set of tasks in flight
        self._requeue: list[TaskRef] = []

    # -- task stream ------------------------------------------------------------------------
    def num_tasks_to_request(self, batch_size: int) -> int:
        """Tasks to start for a batch of `batch_size` groups, given oversampling."""
        return math.ceil(batch_size * self.config.oversampling_factor)

    def next_tasks(self, n: int) -> list[TaskRef]:
        refs: list[TaskRef] = []
        while len(refs) < n and self._requeue:
            refs.append(self._requeue.pop(0))
        while len(refs) < n:
            env = self.env_names[self.mixer.next()]
            index, epoch = self.samplers[env].next()
            refs.append(TaskRef(env, index, epoch))
            self.counters["tasks_issued"] += 1
        for ref in refs:
            self._pending[ref] = None
        return refs

    def complete(self, ref: TaskRef) -> None:
        """The task's group finished (used or filtered): it no longer needs re-issuing on resume."""
        self._pending.pop(ref, None)

    @property
    def pending(self) -> list[TaskRef]:
        return [*self._requeue, *self._pending]

    # -- filters ----------------------------------------------------------------------------
    def accept_group(self, rewards: Sequence[float] | np.ndarray) -> bool:
        """Difficulty filter on a finished group's rewards; counts easy/hard/dropped groups."""
        mean = float(np.mean(rewards)) if len(rewards) else 0.0
        keep, kind = self.filter.keep(mean)
        self.counters["groups_seen"] += 1
        if kind != "normal":
            self.counters[f"groups_{kind}"] += 1
            if not keep:
                self.counters[f"groups_dropped_{kind}"] += 1
        return keep

    def filter_stale(self, oldest_policy_steps: Sequence[int] | np.ndarray, current_step: int) -> np.ndarray:
        """bool keep-mask over samples; drops (and counts) samples beyond max_off_policy_steps."""
        steps = np.asarray(oldest_policy_steps, dtype=np.int64)
        keep = steps >= current_step - self.config.max_off_policy_steps
        self.counters["samples_checked"] += int(steps.size)
        self.counters["samples_stale"] += int(steps.size - keep.sum())
        return keep

    def metrics(self) -> dict[str, float]:
        out = {f"buffer/{k}": float(v) for k, v in self.counters.items()}
        out["buffer/pending"] = float(len(self._pending) + len(self._requeue))
        for name, sampler in self.samplers.items():
            out[f"buffer/epoch/{name}"] = float(sampler.epoch + sampler.cursor / sampler.num_tasks)
        return out

    # -- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "env_names": list(self.env_names),
            "samplers": {name: s.state_dict() for name, s in self.samplers.items()},
            "mixer": self.mixer.state_dict(),
            "filter_decisions": self.filter.decisions,
            "counters": dict(self.counters),
            "pending": [[r.env, r.index, r.epoch] for r in self.pending],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if list(state["env_names"]) != self.env_names:
            raise ValueError(
                f"checkpointed buffer has envs {state['env_names']}, this run has {self.env_names}"
            )
        for name, s in state["samplers"].items():
            self.samplers[name].load_state_dict(s)
        self.mixer.load_state_dict(state["mixer"])
        self.filter.decisions = int(state["filter_decisions"])
        self.counters = {k: int(state["counters"].get(k, 0)) for k in _COUNTERS}
        self._pending = {}
        self._requeue = [TaskRef(env, int(i), int(e)) for env, i, e in state["pending"]]
