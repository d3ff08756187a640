"""The env-server benchmark's environment (scripts/bench/envs.py): single-turn, and its reward burns
`burn_s` seconds of CPU per rollout (50 ms by default) — a stand-in for a CPU-heavy verifier."""

from __future__ import annotations

import time

from hpcrl.envs.base import Environment, Rubric, Task


def burn(task, completion, state) -> float:
    end = time.process_time() + float(task.info["burn_s"])
    x = 0
    while time.process_time() < end:  # a syscall: check once per 2000 additions
        for _ in range(2000):
            x += 1
    return 1.0


class BurnEnv(Environment):
    def __init__(self, num_examples: int, burn_s: float):
        super().__init__(Rubric([(burn, 1.0)]))
        self._tasks = [
            Task(i, [{"role": "user", "content": f"task {i}"}], "", {"burn_s": burn_s})
            for i in range(num_examples)
        ]

    def tasks(self, split: str = "train", seed: int | None = None) -> list[Task]:
        return self._tasks


def load_environment(num_examples: int = 256, burn_s: float = 0.05) -> BurnEnv:
    return BurnEnv(num_examples, burn_s)
