"""prime-rl's names for hpcrl's sections and flags (seed 001, seed 003), accepted and translated.

- `[orchestrator.sampling]` (prime-rl, verifiers docs) is `[orchestrator.train.sampling]`;
- `[orchestrator.teacher.client]` (base_url, api_key_var) is `[orchestrator.teacher]`;
- `[orchestrator.prime_monitor]` / `--orchestrator.prime-monitor` and `--image-tag` / `image_tag` are
  platform settings: accepted with a one-line "ignored here" note, as the hosted shape's are;
- a role's `[trainer.log]` / `[orchestrator.log]` overrides `[log]` field by field;
- `enable_thinking` and `reasoning_effort` exclude each other (seed 002).
"""

from __future__ import annotations

from typing import Any

from hpcrl.config.dicts import deep_merge, get_path, set_path
from hpcrl.config.sections.common import LogConfig
from hpcrl.errors import ConfigError

# (prime-rl's path prefix, hpcrl's path prefix): a flag or table under the first lands under the second.
SECTION_ALIASES = ((("orchestrator", "sampling"), ("orchestrator", "train", "sampling")),)
# Flags only the hosted platform reads: (flag, takes a value).
PLATFORM_FLAGS = {"--image-tag": True, "--orchestrator.prime-monitor": False}
TEACHER_CLIENT_FIELDS = ("base_url", "api_key_var")


def canonical_prefix(parts: list[str]) -> list[str]:
    """A flag path under a prime-rl section name, rewritten under hpcrl's."""
    for alias, canonical in SECTION_ALIASES:
        if tuple(parts[: len(alias)]) == alias:
            return list(canonical) + parts[len(alias) :]
    return parts


def strip_platform_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """Take the platform-only flags out of argv: (the rest, one note per flag)."""
    out: list[str] = []
    notes: list[str] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        name = tok.split("=", 1)[0]
        base = next((f for f in PLATFORM_FLAGS if name == f or name.startswith(f + ".")), None)
        neg = name.startswith("--no-") and ("--" + name[5:]) in PLATFORM_FLAGS
        if base is None and not neg:
            out.append(tok)
            i += 1
            continue
        takes_value = base is not None and (PLATFORM_FLAGS[base] or name != base)
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        skip_value = takes_value and "=" not in tok and nxt is not None and not nxt.startswith("--")
        i += 2 if skip_value else 1
        notes.append(f"{name} is a hosted-platform setting; ignored here")
    return out, notes


def move_sections(d: dict[str, Any], source: str, notes: list[str]) -> None:
    """One file's (native) dict: prime-rl's section names moved to hpcrl's, in place."""
    orch = d.get("orchestrator")
    if not isinstance(orch, dict):
        return
    for alias, canonical in SECTION_ALIASES:
        value = get_path(d, list(alias))
        if value is None:
            continue
        if not isinstance(value, dict):
            raise ConfigError(".".join(alias), f"expected a table ([{'.'.join(alias)}])")
        own = get_path(d, list(canonical))
        own = own if isinstance(own, dict) else {}
        for k, v in value.items():
            if k in own and own[k] != v:
                raise ConfigError(
                    f"{'.'.join(alias)}.{k}", f"conflicts with {'.'.join(canonical)}.{k} (the same setting)"
                )
        get_path(d, list(alias[:-1])).pop(alias[-1])
        set_path(d, list(canonical), deep_merge(own, value))
    if "prime_monitor" in orch:
        orch.pop("prime_monitor")
        notes.append(f"{source}: [orchestrator.prime_monitor] is a hosted-platform setting; ignored here")
    teacher = orch.get("teacher")
    if isinstance(teacher, dict) and "client" in teacher:
        client = teacher.pop("client")
        if not isinstance(client, dict):
            raise ConfigError(
                "orchestrator.teacher.client", "expected a table ([orchestrator.teacher.client])"
            )
        for k, v in client.items():
            if k not in TEACHER_CLIENT_FIELDS:
                raise ConfigError(
                    f"orchestrator.teacher.client.{k}",
                    f"unknown field (allowed: {', '.join(TEACHER_CLIENT_FIELDS)})",
                )
            if k == "base_url" and isinstance(v, list):  # prime-rl takes a list of endpoints
                if len(v) != 1:
                    raise ConfigError("orchestrator.teacher.client.base_url", "expected one endpoint")
                v = v[0]  # noqa: PLW2901
            if k in teacher and teacher[k] != v:
                raise ConfigError(
                    f"orchestrator.teacher.client.{k}", f"conflicts with orchestrator.teacher.{k}"
                )
            teacher[k] = v


def merge_role_logs(merged: dict[str, Any]) -> None:
    """`[trainer.log]` / `[orchestrator.log]` set only what they name; the rest comes from [log]."""
    base = merged.get("log")
    if not isinstance(base, dict):
        return
    base = {k: v for k, v in base.items() if k in LogConfig.__struct_fields__}  # not the run's own (plots)
    for role in ("trainer", "orchestrator"):
        own = get_path(merged, [role, "log"])
        if isinstance(own, dict):
            set_path(merged, [role, "log"], deep_merge(base, own))


def check_thinking(sampling: Any, path: str) -> None:
    """enable_thinking (Qwen3.5, Nemotron) and reasoning_effort (GPT-OSS) exclude each other; a
    sampling table's extra_body (check_extra_body) may set them too, once."""
    if sampling is None:
        return
    check_extra_body(sampling, path)
    if sampling.enable_thinking is not None and sampling.reasoning_effort is not None:
        raise ConfigError(
            f"{path}.reasoning_effort",
            "excludes enable_thinking (set one: enable_thinking for Qwen3.5 / Nemotron, "
            "reasoning_effort for GPT-OSS)",
        )


# Request fields the orchestrator sets itself (the sampling fields, the conversation, the group size,
# logprobs): an extra_body key among them would silently fight them.
_OWN_REQUEST_FIELDS = frozenset(
    {"model", "messages", "prompt", "n", "stream", "stream_options", "logprobs", "top_logprobs", "tools"}
    | {"max_completion_tokens", "echo", "add_generation_prompt", "continue_final_message"}
)


def check_extra_body(sampling: Any, path: str) -> None:
    """prime-rl's `sampling.extra_body`: free request fields, but none the orchestrator sets itself.
    Its `chat_template_kwargs.enable_thinking` / `reasoning_effort` become the sampling fields (one home
    for the switches every prompt is rendered with); set in both places they must agree."""
    extra = getattr(sampling, "extra_body", None)
    if not extra:
        return
    own = set(type(sampling).__struct_fields__) - {"extra_body"}
    for key in extra:
        if key in own or key in _OWN_REQUEST_FIELDS:
            hint = f"set {path}.{key}" if key in own else "the orchestrator sets it for each request"
            raise ConfigError(f"{path}.extra_body.{key}", f"is not a free request field here ({hint})")
    ctk = extra.get("chat_template_kwargs")
    if ctk is None:
        return
    if not isinstance(ctk, dict):
        raise ConfigError(f"{path}.extra_body.chat_template_kwargs", "expected a table")
    for key in ("enable_thinking", "reasoning_effort"):
        if key not in ctk:
            continue
        value, mine = ctk[key], getattr(sampling, key)
        if mine is not None and mine != value:
            raise ConfigError(
                f"{path}.extra_body.chat_template_kwargs.{key}",
                f"= {value!r} differs from {path}.{key} = {mine!r} (set it once)",
            )
        allowed = (True, False) if key == "enable_thinking" else ("low", "medium", "high")
        if value not in allowed:
            raise ConfigError(
                f"{path}.extra_body.chat_template_kwargs.{key}",
                f"must be one of {', '.join(map(repr, allowed))}, got {value!r}",
            )
        setattr(sampling, key, value)
    sampling.extra_body = {
        **extra,
        "chat_template_kwargs": {
            k: v for k, v in ctk.items() if k not in ("enable_thinking", "reasoning_effort")
        },
    }
    if not sampling.extra_body["chat_template_kwargs"]:
        del sampling.extra_body["chat_template_kwargs"]


def default_eval_envs(cfg: Any, notes: list[str]) -> None:
    """`[eval]` without `[[eval.env]]` evaluates the training envs (seed 002: `[[eval.env]]` tables are
    per-env overrides; the defaults are the envs being trained), said in a note."""
    import msgspec

    ev = cfg.orchestrator.eval
    if ev is None or ev.env or not cfg.orchestrator.train.env:
        return
    ev.env = [msgspec.structs.replace(e) for e in cfg.orchestrator.train.env]
    names = ", ".join(e.name or e.id for e in ev.env)
    notes.append(f"[eval] has no [[eval.env]]: evaluating the training env(s) {names}")
