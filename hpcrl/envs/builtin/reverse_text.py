"""reverse-text: reverse a short string character by character; reward = edit-distance similarity.

The easy default is 3-6 lowercase letters with dense partial credit. The CPU learning demo uses the
`reverse-text-demo` variant (3-5 letters, no system prompt: shorter samples) after an SFT warm-up;
from random initialisation RL alone barely moves the reward (docs/demo.md).
"""

from __future__ import annotations

import random
import string
from typing import Any

from hpcrl.envs.base import Message, Rubric, Task
from hpcrl.envs.builtin._common import (
    GeneratedEnvironment,
    builtin_loader,
    chat_prompt,
    last_assistant_text,
    similarity,
    strip_think,
)

SYSTEM_PROMPT = "Reverse the text character by character. Reply with the reversed text only."

# Units are characters for easy/medium and words for hard; lengths count units.
DIFFICULTIES: dict[str, dict[str, Any]] = {
    "easy": {"alphabet": string.ascii_lowercase, "min_len": 3, "max_len": 6, "words": False},
    "medium": {
        "alphabet": string.ascii_lowercase + string.digits,
        "min_len": 6,
        "max_len": 12,
        "words": False,
    },
    "hard": {"alphabet": "", "min_len": 2, "max_len": 5, "words": True},
}

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "green",
    "quick",
    "light",
    "north",
    "paper",
    "music",
    "table",
    "water",
    "horse",
    "dance",
    "bread",
    "chair",
    "smile",
    "train",
    "field",
    "night",
    "plant",
    "sugar",
    "ocean",
    "tiger",
    "lemon",
    "glass",
    "storm",
    "happy",
]


def reversed_text(text: str) -> str:
    return text[::-1]


def reverse_similarity(task: Task, completion: list[Message], state: dict[str, Any]) -> float:
    """1 - normalised Levenshtein distance between the reply and the reversed text."""
    reply = strip_think(last_assistant_text(completion)).strip()
    return similarity(reply, task.answer)


def exact_match(task: Task, completion: list[Message], state: dict[str, Any]) -> float:
    return float(strip_think(last_assistant_text(completion)).strip() == task.answer)


class ReverseTextEnv(GeneratedEnvironment):
    name = "reverse-text"

    def __init__(self, *, min_len: int, max_len: int, difficulty: str, system_prompt: str | None, **kw: Any):
        rubric = Rubric([(reverse_similarity, 1.0), (exact_match, 0.0)])
        super().__init__(rubric, **kw)
        self.min_len, self.max_len = min_len, max_len
        self.spec = DIFFICULTIES[difficulty]
        self.system_prompt = system_prompt

    def make_task(self, rng: random.Random):
        n = rng.randint(self.min_len, self.max_len)
        if self.spec["words"]:
            text = " ".join(rng.choice(WORDS) for _ in range(n))
        else:
            text = "".join(rng.choice(self.spec["alphabet"]) for _ in range(n))
        prompt = chat_prompt(text, self.system_prompt)
        return text, prompt, reversed_text(text), {"text": text}


def _lengths(min_len: int | None, max_len: int | None, difficulty: str) -> dict[str, int]:
    """None lengths become the difficulty's own."""
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty={difficulty!r} is not one of {', '.join(DIFFICULTIES)}")
    spec = DIFFICULTIES[difficulty]
    lo = spec["min_len"] if min_len is None else min_len
    hi = spec["max_len"] if max_len is None else max_len
    if not 1 <= lo <= hi:
        raise ValueError(f"need 1 <= min_len <= max_len, got min_len={lo} max_len={hi}")
    return {"min_len": lo, "max_len": hi}


load_environment = builtin_loader(
    ReverseTextEnv,
    {"min_len": None, "max_len": None, "difficulty": "easy"},
    check=_lengths,
    num_examples=10000,
    system_prompt=SYSTEM_PROMPT,
    doc="""min_len/max_len: length in characters (words for difficulty='hard'); None = the
    difficulty's default. difficulty: easy (3-6 letters), medium (6-12 letters/digits),
    hard (2-5 words).""",
)
