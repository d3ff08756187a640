"""An environment a randomly initialised tiny model learns within a few RL steps: the reward is the
share of the completion's characters that are spaces or letters 'e' (reverse-text prompts). Loaded by
id "tests.integration.short_env"; the MoE RL test uses it to show reward rising from random init."""

from __future__ import annotations

from hpcrl.envs.base import Rubric
from hpcrl.envs.builtin._common import last_assistant_text
from hpcrl.envs.builtin.reverse_text import ReverseTextEnv
from hpcrl.envs.builtin.reverse_text import load_environment as load_reverse_text


def e_share(task, completion, state) -> float:
    text = last_assistant_text(completion)
    return sum(c in " e" for c in text) / max(1, len(text))


def load_environment(num_examples: int = 200) -> ReverseTextEnv:
    env = load_reverse_text(num_examples=num_examples)
    env.rubric = Rubric([(e_share, 1.0)])
    return env
