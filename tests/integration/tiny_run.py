"""The smallest real RL run (tiny model, reverse-text, 16 rollouts of <= 8 tokens per step): the base
config the process-level tests (hpcrl run / submit) start from, plus their own tables."""

TINY_RL = """
max_steps = {steps}
seq_len = 64
[model]
name = "hpcrl/tiny-qwen3"
[orchestrator]
batch_size = 16
rollouts_per_example = 4
[orchestrator.train.sampling]
max_tokens = 8
[[orchestrator.train.env]]
id = "reverse-text"
"""
