"""An environment whose reward function misbehaves on request, for the env-server fault tests:
task.info["do"] is ok | raise | exit (os._exit) | segv (a real segfault) | hang (blocks the worker) |
sleep (0.3 s in env code) | burn (50 ms of CPU, the benchmark's reward). Loaded by id "tests.integration.faulty_env"."""

from __future__ import annotations

import ctypes
import os
import time

from hpcrl.envs.base import Environment, Rubric, Task


def misbehave(task, completion, state) -> float:
    do = task.info.get("do", "ok")
    if do == "raise":
        raise RuntimeError("reward function raised on purpose")
    if do == "exit":
        os._exit(3)
    if do == "segv":
        ctypes.string_at(0)
    if do == "hang":
        time.sleep(3600)
    if do == "sleep":  # env code that takes a while: a kill lands on a rollout in flight
        time.sleep(float(task.info.get("sleep_s", 0.3)))
    if do == "burn":
        end = time.process_time() + float(task.info.get("burn_s", 0.05))
        while time.process_time() < end:
            pass
    return 1.0 if "ok" in str(completion[-1].get("content", "")) else 0.0


class FaultyEnv(Environment):
    def __init__(self, dos: list[str]):
        super().__init__(Rubric([(misbehave, 1.0)]))
        self._tasks = [
            Task(i, [{"role": "user", "content": f"say ok ({do})"}], "ok", {"do": do})
            for i, do in enumerate(dos)
        ]

    def tasks(self, split: str = "train", seed: int | None = None) -> list[Task]:
        return self._tasks


def load_environment(
    dos: list[str] | None = None, num_examples: int = 8, do: str = "ok", **info: float
) -> FaultyEnv:
    env = FaultyEnv(dos if dos is not None else [do] * num_examples)
    for t in env._tasks:
        t.info.update(info)  # sleep_s / burn_s
    return env
