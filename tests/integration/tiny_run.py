"""The smallest real RL run (tiny model, reverse-text, 16 rollouts of <= 8 tokens per step): the base
config the process-level tests (hpcrl run / submit) start from, plus their own tables."""

from tests.conftest import rl_toml

TINY_RL = rl_toml("{steps}", seq_len=64, max_tokens=8)

# The tiny run with env code that takes a while (16 rollouts x 0.1 s of sleep in the env worker per
# step): a step lasts ~1.6 s of wall time at almost no CPU, a window for the killed server's restart
# that does not depend on how fast this machine is (test_dead_server ran 200 tiny steps instead: ~40 CPU-s a run).
SLOW_RL = rl_toml(
    "{steps}", seq_len=64, max_tokens=8, tables='[orchestrator.advantage]\nzero_advantage = "keep"\n'
).replace(
    'id = "reverse-text"\n',
    'id = "tests.integration.faulty_env"\nname = "faulty"\nargs = {{do = "sleep", sleep_s = 0.1, num_examples = 16}}\n',
)
