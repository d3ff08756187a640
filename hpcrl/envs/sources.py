"""A prime-rl source (an env entry with verifiers' own env table, hpcrl.config.prime_sources) whose
taskset is not installed here as a verifiers 0.4 package."""

from __future__ import annotations

from typing import Any

import msgspec

from hpcrl.errors import ConfigError


def source_fallback(e: Any, where: str, notes: list[str]) -> Any:
    """With the `null` harness (the model answers the task's prompt directly, no agent program), no
    other seats, and an env of that id here (hpcrl's built-ins: reverse-text, alphabet-sort, ...),
    that env runs instead, said in a note; anything else is refused in one line naming the taskset
    (a harness needs the real taskset). The taskset's own scalar fields that the env takes as
    arguments (color-codeword's `images_per_turn`) become its args; the note names the others, which
    hpcrl's env does not read. `e`: an EnvConfig whose `env` table is set."""
    import inspect

    from hpcrl.envs.registry import EnvSpecError, resolve_factory

    agent = e.env.get("agent") if isinstance(e.env.get("agent"), dict) else {}
    harness = agent.get("harness")
    harness_id = harness.get("id", "null") if isinstance(harness, dict) else "null"
    seats = [k for k in e.env if k not in ("id", "taskset", "agent")]
    try:
        params = inspect.signature(resolve_factory(e.id)).parameters
        here = True
    except EnvSpecError:
        here, params = False, {}
    if harness_id != "null" or seats or not here:
        raise ConfigError(
            f"{where}.env.taskset.id",
            f"taskset {e.id!r} is not installed as a verifiers 0.4 package here (install it, e.g. "
            f"`prime env install {e.id}`, or pip install its package)",
        )
    taskset = e.env.get("taskset") if isinstance(e.env.get("taskset"), dict) else {}
    fields = {k: v for k, v in taskset.items() if k != "id"}
    args = {k: v for k, v in fields.items() if k in params and not isinstance(v, (dict, list))}
    unread = sorted(set(fields) - set(args))
    notes.append(
        f"{where}: taskset {e.id!r} is not installed as a verifiers 0.4 package; running hpcrl's env "
        f"{e.id!r} instead (harness 'null': the model answers each prompt directly, as there)"
        + (f"; taskset fields as its args: {', '.join(sorted(args))}" if args else "")
        + (f"; not read by it: {', '.join(unread)}" if unread else "")
    )
    return msgspec.structs.replace(e, env={}, runtime=None, args={**args, **e.args})
