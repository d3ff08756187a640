"""The smallest real RL run (tiny model, reverse-text, 16 rollouts of <= 8 tokens per step): the base
config the process-level tests (hpcrl run / submit) start from, plus their own tables."""

from tests.conftest import rl_toml

TINY_RL = rl_toml("{steps}", seq_len=64, max_tokens=8)
