"""reverse-text-demo: reverse-text with the CPU learning demo's settings as its defaults.

3-5 lowercase letters and no system prompt. Without the system prompt a sample is ~25 tokens instead
of ~65, so SFT and RL steps on 2 CPU cores are about twice as fast, and the 0.35 M-parameter tiny model
learns the reversal within ~200 SFT steps. It is a separate id (rather than arguments) because the SFT
data generator (`python -m hpcrl.trainer.sft_data make-demo --task ID`) takes only an environment id:
SFT data, RL rollouts and eval then come from the same task distribution by construction.
"""

from __future__ import annotations

from hpcrl.envs.builtin._common import builtin_loader
from hpcrl.envs.builtin.reverse_text import ReverseTextEnv, _lengths

DEMO_MIN_LEN = 3
DEMO_MAX_LEN = 5


def _easy(min_len: int, max_len: int) -> dict[str, object]:
    return {"difficulty": "easy", **_lengths(min_len, max_len, "easy")}


load_environment = builtin_loader(
    ReverseTextEnv,
    {"min_len": DEMO_MIN_LEN, "max_len": DEMO_MAX_LEN},
    check=_easy,
    num_examples=10000,
    system_prompt=None,
    doc="""reverse-text (difficulty easy: lowercase letters) with demo defaults: min_len=3, max_len=5,
    system_prompt=None. Every argument can still be overridden.""",
)
