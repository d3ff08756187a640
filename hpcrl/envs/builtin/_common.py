"""Helpers shared by the built-in environments: locally generated splits, text metrics, parsing."""

from __future__ import annotations

import inspect
import random
import re
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from hpcrl.envs.base import Environment, Message, Rubric, Task, normalize_split

# ---------------------------------------------------------------------------------------------
# Generated data
# ---------------------------------------------------------------------------------------------

Maker = Callable[[random.Random], tuple[Hashable, list[Message], str, dict[str, Any]]]
"""rng -> (dedup key, prompt messages, answer, info)."""


def generate_splits(make: Maker, sizes: dict[str, int], seed: int) -> dict[str, list[Task]]:
    """Draw unique tasks from one seeded stream: the first sizes['train'] go to train, then eval,
    then val, so splits never overlap and each split is stable when only a later split's size
    changes. `random.Random` is used because its integer draws are stable across Python versions."""
    rng = random.Random(seed)
    seen: set[Hashable] = set()
    out: dict[str, list[Task]] = {}
    total = sum(sizes.values())
    budget = 50 * total + 1000
    for split in ("train", "eval", "val"):
        tasks: list[Task] = []
        while len(tasks) < sizes.get(split, 0):
            if budget == 0:
                raise ValueError(
                    f"only {len(seen)} distinct tasks exist for these arguments but {total} were asked "
                    "for; lower num_examples/num_eval_examples or widen the task space"
                )
            budget -= 1
            key, prompt, answer, info = make(rng)
            if key in seen:
                continue
            seen.add(key)
            tasks.append(Task(example_id=len(tasks), prompt=prompt, answer=answer, info=info))
        out[split] = tasks
    return out


class GeneratedEnvironment(Environment):
    """An environment whose tasks come from `make_task(rng)`; splits are cached per seed.

    `split` (a constructor argument in hosted configs, e.g. `args = {split = "test"}`) pins the
    split this instance serves: tasks(<any split>) then returns that split.
    """

    def __init__(
        self,
        rubric: Rubric,
        *,
        num_examples: int,
        num_eval_examples: int,
        num_val_examples: int,
        seed: int,
        split: str | None = None,
    ) -> None:
        super().__init__(rubric)
        for arg, n in (
            ("num_examples", num_examples),
            ("num_eval_examples", num_eval_examples),
            ("num_val_examples", num_val_examples),
        ):
            if n < 0:
                raise ValueError(f"{arg} must be >= 0, got {n}")
        self.sizes = {"train": num_examples, "eval": num_eval_examples, "val": num_val_examples}
        self.seed = seed
        self.pinned_split = normalize_split(split) if split is not None else None
        self._cache: dict[int, dict[str, list[Task]]] = {}

    def make_task(self, rng: random.Random) -> tuple[Hashable, list[Message], str, dict[str, Any]]:
        raise NotImplementedError

    def tasks(self, split: str = "train", seed: int | None = None) -> Sequence[Task]:
        split = self.pinned_split or normalize_split(split)
        seed = self.seed if seed is None else seed
        if seed not in self._cache:
            self._cache[seed] = generate_splits(self.make_task, self.sizes, seed)
        return self._cache[seed][split]


def chat_prompt(user: str, system: str | None = None) -> list[Message]:
    msgs: list[Message] = []
    if system:
        msgs.append({"role": "system", "content": system})
    msgs.append({"role": "user", "content": user})
    return msgs


# ---------------------------------------------------------------------------------------------
# Text metrics and parsing
# ---------------------------------------------------------------------------------------------


def levenshtein(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Edit distance (insert/delete/substitute, cost 1) between two sequences."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def similarity(a: Sequence[Hashable], b: Sequence[Hashable]) -> float:
    """1 - levenshtein / max(len): 1.0 for identical, 0.0 for nothing in common."""
    n = max(len(a), len(b))
    return 1.0 if n == 0 else 1.0 - levenshtein(a, b) / n


def last_assistant_text(completion: list[Message]) -> str:
    for msg in reversed(completion):
        if msg.get("role") == "assistant":
            content = msg.get("content")
            return content if isinstance(content, str) else ""
    return ""


_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


def strip_think(text: str) -> str:
    """Drop reasoning blocks so rewards judge only the final answer."""
    return _THINK.sub("", text)


_NUM = r"-?\d[\d,]*(?:\.\d+)?"
_HASHES = re.compile(r"####\s*(" + _NUM + ")")
_BOXED = re.compile(r"\\boxed\{\s*(" + _NUM + r")\s*\}")
_ANY_NUM = re.compile(_NUM)


def extract_number(text: str) -> str | None:
    """gsm8k-style final answer: '#### 42', else the last \\boxed{42}, else the last number.
    Commas are removed and integral floats normalised ('1,000.0' -> '1000')."""
    text = strip_think(text)
    for pattern in (_HASHES, _BOXED, _ANY_NUM):
        found = pattern.findall(text)
        if found:
            return normalize_number(found[-1])
    return None


def normalize_number(s: str) -> str:
    s = s.replace(",", "").strip()
    try:
        value = float(s)
    except ValueError:
        return s
    if value.is_integer():
        return str(int(value))
    return repr(round(value, 6))


# ---------------------------------------------------------------------------------------------
# The one load_environment shape of the built-ins
# ---------------------------------------------------------------------------------------------
def builtin_loader(
    env_cls: Callable[..., Environment],
    own: dict[str, Any],
    *,
    check: Callable[..., dict[str, Any] | None] | None = None,
    num_examples: int = 5000,
    num_eval_examples: int = 200,
    num_val_examples: int = 64,
    system_prompt: str | None | object = inspect.Parameter.empty,
    doc: str = "",
) -> Callable[..., Environment]:
    """A built-in's `load_environment`: its own arguments (`own`, name -> default, in order) then the
    arguments every generated env takes (split sizes, seed, `system_prompt` where the env has one,
    `split`). `check(**args)` refuses bad values with a ValueError and may return values to use
    instead (reverse-text's None lengths become its difficulty's). The function's signature is the
    real one: the env registry checks hosted `args = {...}` against it."""
    common: dict[str, Any] = {
        "num_examples": num_examples,
        "num_eval_examples": num_eval_examples,
        "num_val_examples": num_val_examples,
        "seed": 0,
    }
    if system_prompt is not inspect.Parameter.empty:
        common["system_prompt"] = system_prompt
    common["split"] = None
    defaults = {**own, **common}
    params = [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=v) for n, v in defaults.items()
    ]

    def load_environment(*args: Any, **kwargs: Any) -> Environment:
        bound = load_environment.__signature__.bind(*args, **kwargs)  # type: ignore[attr-defined]
        bound.apply_defaults()
        values = dict(bound.arguments)
        if check is not None:
            values.update(check(**{k: values[k] for k in own}) or {})
        return env_cls(**values)

    load_environment.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    load_environment.__doc__ = doc
    return load_environment
