"""reverse-text-demo: reverse-text with the CPU learning demo's settings as its defaults.

3-5 lowercase letters and no system prompt. Without the system prompt a sample is ~25 tokens instead
of ~65, so SFT and RL steps on 2 CPU cores are about twice as fast, and the 0.35 M-parameter tiny model
learns the reversal within ~200 SFT steps. It is a separate id (rather than arguments) because the SFT
data generator (`python -m hpcrl.trainer.sft_data make-demo --task ID`) takes only an environment id:
SFT data, RL rollouts and eval then come from the same task distribution by construction.
"""

from __future__ import annotations

from hpcrl.envs.builtin.reverse_text import ReverseTextEnv
from hpcrl.envs.builtin.reverse_text import load_environment as load_reverse_text

DEMO_MIN_LEN = 3
DEMO_MAX_LEN = 5


def load_environment(
    min_len: int = DEMO_MIN_LEN,
    max_len: int = DEMO_MAX_LEN,
    num_examples: int = 10000,
    num_eval_examples: int = 200,
    num_val_examples: int = 64,
    seed: int = 0,
    system_prompt: str | None = None,
    split: str | None = None,
) -> ReverseTextEnv:
    """reverse-text (difficulty easy: lowercase letters) with demo defaults: min_len=3, max_len=5,
    system_prompt=None. Every argument can still be overridden."""
    return load_reverse_text(
        min_len=min_len,
        max_len=max_len,
        difficulty="easy",
        num_examples=num_examples,
        num_eval_examples=num_eval_examples,
        num_val_examples=num_val_examples,
        seed=seed,
        system_prompt=system_prompt,
        split=split,
    )
