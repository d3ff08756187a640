"""arithmetic (alias gsm8k): templated grade-school word problems with integer answers.

Answers are extracted gsm8k-style ('#### 42', else \\boxed{42}, else the last number in the reply),
so real gsm8k-trained models and tiny models alike are scored the same way.
"""

from __future__ import annotations

import random
from typing import Any

from hpcrl.envs.base import Message, Rubric, Task
from hpcrl.envs.builtin._common import (
    GeneratedEnvironment,
    builtin_loader,
    chat_prompt,
    extract_number,
    last_assistant_text,
)

SYSTEM_PROMPT = "Solve the problem. End your reply with the final answer as '#### <number>'."

PEOPLE = ["Tom", "Ana", "Raj", "Mia", "Leo", "Sofia", "Ben", "Zara", "Omar", "Lily"]
ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "coins", "stamps", "shells", "cards"]


def _add(rng: random.Random, hi: int) -> tuple[str, int]:
    p, it = rng.choice(PEOPLE), rng.choice(ITEMS)
    a, b = rng.randint(1, hi), rng.randint(1, hi)
    return f"{p} has {a} {it}. {p} gets {b} more {it}. How many {it} does {p} have now?", a + b


def _sub(rng: random.Random, hi: int) -> tuple[str, int]:
    p, it = rng.choice(PEOPLE), rng.choice(ITEMS)
    a = rng.randint(2, hi)
    b = rng.randint(1, a - 1)
    return f"{p} had {a} {it} and gave away {b}. How many {it} are left?", a - b


def _mul(rng: random.Random, hi: int) -> tuple[str, int]:
    p, it = rng.choice(PEOPLE), rng.choice(ITEMS)
    a, b = rng.randint(2, max(2, hi // 4)), rng.randint(2, 12)
    return f"{p} buys {a} boxes with {b} {it} in each box. How many {it} does {p} buy?", a * b


def _two_step(rng: random.Random, hi: int) -> tuple[str, int]:
    p, q, it = *rng.sample(PEOPLE, 2), rng.choice(ITEMS)
    a, b, c = rng.randint(1, hi), rng.randint(2, 6), rng.randint(2, 10)
    return (
        f"{p} has {a} {it}. {q} gives {p} {b} bags with {c} {it} each. How many {it} does {p} have in total?"
    ), a + b * c


def _share(rng: random.Random, hi: int) -> tuple[str, int]:
    p, it = rng.choice(PEOPLE), rng.choice(ITEMS)
    k, each = rng.randint(2, 8), rng.randint(1, max(1, hi // 4))
    extra = rng.randint(0, hi)
    return (
        f"{p} had {k * each + extra} {it}, kept {extra} and shared the rest equally among {k} friends. "
        f"How many {it} did each friend get?"
    ), each


TEMPLATES = {"easy": (_add, _sub), "medium": (_add, _sub, _mul), "hard": (_mul, _two_step, _share)}


def correct_answer(task: Task, completion: list[Message], state: dict[str, Any]) -> float:
    return float(extract_number(last_assistant_text(completion)) == task.answer)


def uses_hash_format(task: Task, completion: list[Message], state: dict[str, Any]) -> float:
    return float("####" in last_assistant_text(completion))


class ArithmeticEnv(GeneratedEnvironment):
    name = "arithmetic"

    def __init__(
        self, *, difficulty: str, max_number: int, format_weight: float, system_prompt: str | None, **kw: Any
    ):
        super().__init__(Rubric([(correct_answer, 1.0), (uses_hash_format, format_weight)]), **kw)
        self.templates = TEMPLATES[difficulty]
        self.max_number = max_number
        self.system_prompt = system_prompt

    def make_task(self, rng: random.Random):
        question, answer = rng.choice(self.templates)(rng, self.max_number)
        return question, chat_prompt(question, self.system_prompt), str(answer), {"question": question}


def _check(difficulty: str, max_number: int, format_weight: float) -> None:
    if difficulty not in TEMPLATES:
        raise ValueError(f"difficulty={difficulty!r} is not one of {', '.join(TEMPLATES)}")
    if max_number < 4:
        raise ValueError(f"max_number must be >= 4, got {max_number}")


load_environment = builtin_loader(
    ArithmeticEnv,
    {"difficulty": "medium", "max_number": 50, "format_weight": 0.0},
    check=_check,
    system_prompt=SYSTEM_PROMPT,
    doc="""difficulty: easy (+/-), medium (+, -, x), hard (two-step and division). format_weight adds
    that much reward for using the '#### n' answer format (always reported as a metric).""",
)
