"""alphabet-sort: multi-turn. Each user turn adds names; the model replies with the cumulative,
alphabetically sorted list (one name per line). Reward = mean over the task's turns of the
edit-distance similarity between the reply's list and the expected list (a missing turn scores 0).
"""

from __future__ import annotations

import random
import re
from typing import Any

from hpcrl.envs.base import Message, Rubric, Task
from hpcrl.envs.builtin._common import (
    GeneratedEnvironment,
    builtin_loader,
    chat_prompt,
    similarity,
    strip_think,
)

SYSTEM_PROMPT = (
    "Sort names alphabetically. Each time you are given names, reply with ALL names given so far, "
    "sorted alphabetically, one per line, and nothing else."
)

NAMES = [
    "Ada",
    "Alan",
    "Alice",
    "Amara",
    "Anton",
    "Aria",
    "Basil",
    "Bea",
    "Bruno",
    "Carla",
    "Cedric",
    "Chloe",
    "Dario",
    "Diana",
    "Dmitri",
    "Edgar",
    "Elena",
    "Emil",
    "Enzo",
    "Fatima",
    "Felix",
    "Fiona",
    "Gavin",
    "Greta",
    "Hana",
    "Hugo",
    "Ines",
    "Ivan",
    "Jade",
    "Jonas",
    "Julia",
    "Kai",
    "Kira",
    "Lars",
    "Lena",
    "Leon",
    "Lucia",
    "Maya",
    "Milo",
    "Nadia",
    "Nico",
    "Nora",
    "Omar",
    "Olga",
    "Oscar",
    "Paula",
    "Pedro",
    "Quinn",
    "Rafael",
    "Rosa",
    "Ruth",
    "Sami",
    "Sara",
    "Soren",
    "Tariq",
    "Tess",
    "Theo",
    "Uma",
    "Uri",
    "Vera",
    "Victor",
    "Wanda",
    "Wendel",
    "Xavier",
    "Yara",
    "Yusuf",
    "Zoe",
    "Zeno",
]

_BULLET = re.compile(r"^\s*(?:[-*\u2022]|\d+[.)])\s*")


def parse_names(text: str) -> list[str]:
    """Names from a reply: one per line or comma separated; bullets and numbering ignored."""
    text = strip_think(text)
    parts = re.split(r"[\n,]", text)
    return [_BULLET.sub("", p).strip() for p in parts if _BULLET.sub("", p).strip()]


def turn_scores(task: Task, completion: list[Message]) -> list[float]:
    expected: list[list[str]] = task.info["expected"]
    replies = [m for m in completion if m.get("role") == "assistant"]
    scores = []
    for i, want in enumerate(expected):
        got = parse_names(replies[i].get("content") or "") if i < len(replies) else None
        scores.append(0.0 if got is None else similarity(got, want))
    return scores


def sorted_lists(task: Task, completion: list[Message], state: dict[str, Any]) -> float:
    """Mean per-turn similarity of name lists (edit distance over names)."""
    scores = turn_scores(task, completion)
    return sum(scores) / len(scores)


def all_turns_exact(task: Task, completion: list[Message], state: dict[str, Any]) -> float:
    return float(all(s == 1.0 for s in turn_scores(task, completion)))


def _user_text(names: list[str], first: bool) -> str:
    listed = ", ".join(names)
    return (
        f"Sort these names: {listed}" if first else f"Add these names and give the full sorted list: {listed}"
    )


class AlphabetSortEnv(GeneratedEnvironment):
    name = "alphabet-sort"

    def __init__(
        self,
        *,
        min_turns: int,
        max_turns: int,
        min_names_per_turn: int,
        max_names_per_turn: int,
        system_prompt: str | None,
        **kw: Any,
    ):
        super().__init__(Rubric([(sorted_lists, 1.0), (all_turns_exact, 0.0)]), **kw)
        self.min_turns, self.max_turns = min_turns, max_turns
        self.min_names, self.max_names = min_names_per_turn, max_names_per_turn
        self.system_prompt = system_prompt

    def make_task(self, rng: random.Random):
        n_turns = rng.randint(self.min_turns, self.max_turns)
        per_turn = [rng.randint(self.min_names, self.max_names) for _ in range(n_turns)]
        names = rng.sample(NAMES, sum(per_turn))
        batches, expected, start = [], [], 0
        for k in per_turn:
            batches.append(names[start : start + k])
            start += k
            expected.append(sorted(names[:start]))
        prompt = chat_prompt(_user_text(batches[0], True), self.system_prompt)
        return (
            tuple(map(tuple, batches)),
            prompt,
            "\n".join(expected[-1]),
            {"batches": batches, "expected": expected},
        )

    def initial_state(self, task: Task) -> dict[str, Any]:
        return {"turn": 0}

    async def env_response(self, task: Task, messages: list[Message], state: dict[str, Any]):
        # The next batch of names regardless of the reply's quality: every turn is scored
        # independently against the cumulative expected list.
        state["turn"] += 1
        batches = task.info["batches"]
        if state["turn"] >= len(batches):
            return [], True
        return [{"role": "user", "content": _user_text(batches[state["turn"]], False)}], False


def _check(min_turns: int, max_turns: int, min_names_per_turn: int, max_names_per_turn: int) -> None:
    if not 1 <= min_turns <= max_turns:
        raise ValueError(f"need 1 <= min_turns <= max_turns, got {min_turns}, {max_turns}")
    if not 1 <= min_names_per_turn <= max_names_per_turn:
        raise ValueError(
            f"need 1 <= min_names_per_turn <= max_names_per_turn, got {min_names_per_turn}, "
            f"{max_names_per_turn}"
        )
    if max_turns * max_names_per_turn > len(NAMES):
        raise ValueError(f"max_turns * max_names_per_turn must be <= {len(NAMES)} (the built-in name list)")


load_environment = builtin_loader(
    AlphabetSortEnv,
    {"min_turns": 1, "max_turns": 3, "min_names_per_turn": 1, "max_names_per_turn": 3},
    check=_check,
    system_prompt=SYSTEM_PROMPT,
    doc="""Each task has between min_turns and max_turns user turns, each adding
    min_names_per_turn..max_names_per_turn new (distinct) names.""",
)
