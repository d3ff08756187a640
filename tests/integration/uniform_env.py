"""An environment whose every completion gets the same reward (a task the policy has "mastered"):
every group has zero advantage. Loaded by id "tests.integration.uniform_env"."""

from __future__ import annotations

from hpcrl.envs.base import Rubric
from hpcrl.envs.builtin.reverse_text import ReverseTextEnv
from hpcrl.envs.builtin.reverse_text import load_environment as load_reverse_text


def always_one(task, completion, state) -> float:
    return 1.0


def load_environment(num_examples: int = 50) -> ReverseTextEnv:
    env = load_reverse_text(num_examples=num_examples)
    env.rubric = Rubric([(always_one, 1.0)])
    return env
