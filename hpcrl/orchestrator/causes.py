"""Why rollouts error, per env: named once, counted always, and a systematic failure ends the run.

Every errored rollout keeps its cause ("ExceptionType: one-line message", RolloutRecord.error): from
the env server, verifiers' interception server, the inference server or the client. `Causes` groups
those by env and by a key with the numbers masked (ports, pids, ids differ; the failure does not):

- the first occurrence of each cause per env is one WARNING, and again at 10, 100, 1000 ... with the
  running count (so a run that keeps erroring keeps saying so, without a line per rollout);
- `metrics()` counts errored rollouts by env and cause (`errors/<env>/<cause>`), and `write()` keeps
  the totals in logs/causes.json for `hpcrl status`;
- `check()` raises SystematicFailure when an env's last `window` rollouts all failed with the same
  cause and it never succeeded since the run started, or its last `window` rollouts all failed the
  same way. Occasional errors only count. The message names the env, the cause and the fix where
  one is known (FIXES). A lost worker or env server (EnvComponentLost, its message naming the lost
  pid) errors every rollout it held at once: all of them are counted, but the event enters the
  window once, so one restart never ends a run while a worker that dies on every rollout still does.
"""

from __future__ import annotations

import json
import logging
import re
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger("hpcrl.orchestrator")

MAX_CAUSE = 300  # characters of a cause kept (first line only)
LOST = "EnvComponentLost: "  # hpcrl.orchestrator.remote_env.EnvComponentLost, as a rollout's error reads

# (pattern on the cause, the fix to name). Checked in order; the first match wins.
FIXES: list[tuple[re.Pattern[str], str]] = [
    (
        re.compile(r"does not support tools|renderer .* (has )?no tool", re.I),
        'the renderer cannot render tool calls: name one that can, e.g. orchestrator.renderer.name = "qwen3"',
    ),
    (
        re.compile(r"ModuleNotFoundError|No module named", re.I),
        "the environment's package is not installed where the env server runs (pip install it there)",
    ),
    (
        re.compile(r"context length|maximum context|too long|413", re.I),
        "prompts exceed the model's context: raise seq_len or lower orchestrator.train.sampling.max_tokens",
    ),
    (
        re.compile(r"401|403|unauthori[sz]ed|api[_ ]key", re.I),
        "the request was refused for its credentials: check server.api_key / the env's API key",
    ),
]


class SystematicFailure(RuntimeError):
    """Every recent rollout of one env failed with the same cause: the run ends naming it."""


def cause_of(error: str) -> str:
    """The one-line cause of an error string: never empty (a bare exception type says so)."""
    line = (error or "").strip().splitlines()[0] if (error or "").strip() else ""
    if not line:
        return "unknown error (no message)"
    if line.endswith(":"):  # "ReadError: " -> the type alone says what happened, say there is no more
        line = f"{line[:-1]} (no message)"
    return line[:MAX_CAUSE]


_NUMBERS = re.compile(r"0x[0-9a-f]+|\d+(\.\d+)?", re.I)


def cause_key(cause: str) -> str:
    """`cause` with its numbers masked: the same failure on another port / pid / example is one cause."""
    return _NUMBERS.sub("#", cause)


def fix_for(cause: str) -> str | None:
    for pattern, fix in FIXES:
        if pattern.search(cause):
            return fix
    return None


class _EnvCauses:
    def __init__(self, window: int):
        self.counts: Counter[str] = Counter()  # cause key -> errored rollouts
        self.example: dict[str, str] = {}  # cause key -> the first cause seen under it (for messages)
        self.recent: deque[str | None] = deque(maxlen=max(1, window))  # None = a rollout that succeeded
        self.successes = 0
        self.lost: deque[str] = deque(maxlen=64)  # the latest lost-component events (their causes)


class Causes:
    def __init__(self, window: int = 64):
        self.window = window  # 0 = never end the run (count only)
        self.envs: dict[str, _EnvCauses] = {}
        self.new: Counter[tuple[str, str]] = Counter()  # since the last metrics(): (env, key) -> count

    def observe(self, env: str, errors: Iterable[str | None]) -> None:
        """One group's rollouts of `env`: each its error string or None (it succeeded)."""
        e = self.envs.setdefault(env, _EnvCauses(self.window))
        for err in errors:
            if err is None:
                e.successes += 1
                e.recent.append(None)
                continue
            cause = cause_of(err)
            key = cause_key(cause)
            e.example.setdefault(key, cause)
            e.counts[key] += 1
            if cause.startswith(LOST):  # one event (a lost pid) errors all it held: it enters once
                if cause not in e.lost:
                    e.lost.append(cause)
                    e.recent.append(key)
            else:
                e.recent.append(key)
            self.new[(env, key)] += 1
            n = e.counts[key]
            if n == 1 or _power_of_ten(n):
                fix = fix_for(cause)
                log.warning(
                    "env %s: rollout errored: %s (%s%d so far, %d succeeded)%s",
                    env,
                    cause,
                    "first occurrence; " if n == 1 else "",
                    n,
                    e.successes,
                    f"; fix: {fix}" if fix else "",
                )

    def check(self) -> None:
        """SystematicFailure when an env's last `window` rollouts all failed with one cause."""
        if self.window <= 0:
            return
        for env, e in sorted(self.envs.items()):
            if len(e.recent) < self.window or e.recent[0] is None:
                continue
            key = e.recent[0]
            if all(k == key for k in e.recent):
                since = "since the run started" if e.successes == 0 else f"in its last {self.window} rollouts"
                fix = fix_for(e.example[key])
                raise SystematicFailure(
                    f"env {env}: every rollout fails ({e.counts[key]} errored, none succeeded {since}): "
                    f"{e.example[key]}"
                    + (f"; fix: {fix}" if fix else "")
                    + f" (orchestrator.systematic_error_rollouts = {self.window})"
                )

    def metrics(self) -> dict[str, float]:
        """Cumulative errored rollouts by env and cause: `errors/<env>/<cause key>`."""
        return {
            f"errors/{env}/{key}": float(n) for env, e in self.envs.items() for key, n in e.counts.items()
        }

    def top(self, k: int = 5) -> list[tuple[str, str, int]]:
        rows = [(env, e.example[key], n) for env, e in self.envs.items() for key, n in e.counts.items()]
        return sorted(rows, key=lambda r: -r[2])[:k]

    def write(self, path: Path) -> None:
        """The totals for `hpcrl status` (logs/causes.json; atomic)."""
        from hpcrl.fileio import write_text

        doc = {
            env: {"successes": e.successes, "causes": {e.example[k]: n for k, n in e.counts.most_common()}}
            for env, e in self.envs.items()
        }
        write_text(path, json.dumps(doc, indent=1))


def _power_of_ten(n: int) -> bool:
    while n >= 10 and n % 10 == 0:
        n //= 10
    return n == 1


def check_tools(envs: Mapping[str, Any], renderers: Any, tokenizer: Any) -> None:
    """Before the first rollout: an env that declares tools under a renderer that cannot render them
    would error every rollout; a one-line ConfigError instead (the same fix FIXES names)."""
    from hpcrl.errors import ConfigError

    for name, env in sorted(envs.items()):
        if not getattr(env, "tools", None):
            continue
        if renderers is not None:
            renderer = renderers.get(None)
            ok, what = getattr(renderer, "supports_tools", True), f"renderer {type(renderer).__name__}"
        else:
            ok, what = (
                "tools" in (getattr(tokenizer, "chat_template", None) or ""),
                "the tokenizer's chat template",
            )
        if not ok:
            raise ConfigError(
                "orchestrator.renderer.name",
                f"env {name} declares {len(env.tools)} tool(s) and {what} cannot render tools: "
                'name a renderer that can, e.g. orchestrator.renderer.name = "qwen3"',
            )
