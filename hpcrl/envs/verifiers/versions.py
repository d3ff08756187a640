"""Which verifiers API an environment is written for, and a one-line refusal when this venv has the
other one. verifiers 0.3 (classic: `load_environment()` -> `vf.Environment`, SingleTurnEnv, Rubric...)
and 0.4 (only `verifiers.v1`: Taskset, Env, harnesses, serve) cannot share a venv."""

from __future__ import annotations

import importlib.metadata

CLASSIC_NEEDS = "verifiers>=0.3.1,<0.4"
V1_NEEDS = "verifiers==0.4.0 renderers==0.1.12"
# Names of the classic API that 0.4 deleted: an env touching one of them is a 0.3 env.
CLASSIC_NAMES = (
    "Environment",
    "SingleTurnEnv",
    "MultiTurnEnv",
    "ToolEnv",
    "StatefulToolEnv",
    "Rubric",
    "Parser",
    "XMLParser",
    "ThinkParser",
    "JudgeRubric",
    "load_example_dataset",
)


def installed() -> str | None:
    try:
        return importlib.metadata.version("verifiers")
    except importlib.metadata.PackageNotFoundError:
        return None


def major_minor(version: str | None) -> tuple[int, int] | None:
    if not version:
        return None
    parts = [p for p in version.split(".")[:2] if p.isdigit()]
    return (int(parts[0]), int(parts[1])) if len(parts) == 2 else None


def needs(env_id: str, api: str, have: str | None) -> str:
    """The one line: env, the version it needs, what this venv has, how to get the right one."""
    want = CLASSIC_NEEDS if api == "0.3" else V1_NEEDS
    kind = "the classic API (load_environment -> vf.Environment)" if api == "0.3" else "verifiers.v1"
    return (
        f"environment {env_id!r} is written for verifiers {api} ({kind}) but this venv has "
        f"{'no verifiers' if have is None else f'verifiers {have}'}: run it from a venv with "
        f"pip install {' '.join(repr(x) for x in want.split())}"
    )


def explain(env_id: str, error: BaseException) -> str | None:
    """The version refusal when `error` (raised importing or building the env) comes from the
    other verifiers API; None when it is some other failure."""
    have = installed()
    text = str(error)
    mm = major_minor(have)
    if isinstance(error, ModuleNotFoundError) and (error.name or "").startswith("verifiers.v1"):
        return needs(env_id, "0.4", have)
    if isinstance(error, ModuleNotFoundError) and error.name == "verifiers" and have is None:
        return None  # no verifiers at all: the plain import error says it best
    newer = mm is not None and mm >= (0, 4) and isinstance(error, (AttributeError, ImportError))
    if newer and "verifiers" in text and any(f"'{n}'" in text for n in CLASSIC_NAMES):
        return needs(env_id, "0.3", have)
    return None


def is_v1_object(obj: object) -> bool:
    """A verifiers.v1 class or instance (Taskset, Env, Task...), decided without importing verifiers."""
    cls = obj if isinstance(obj, type) else type(obj)
    return any(c.__module__.startswith("verifiers.v1") for c in cls.__mro__[1:] or cls.__mro__)


def v1_exports(module: object) -> list[str]:
    """Names a module exports (`__all__`) that are verifiers.v1 Taskset/Env subclasses: a v1 env."""
    out = []
    for name in getattr(module, "__all__", None) or []:
        obj = getattr(module, name, None)
        if isinstance(obj, type) and any(
            c.__module__.startswith("verifiers.v1") and c.__name__ in ("Taskset", "Env")
            for c in obj.__mro__[1:]
        ):
            out.append(name)
    return out


def v1_refusal(env_id: str) -> str:
    """A verifiers 0.4 (v1) env: the version line when this venv lacks 0.4, else what is missing."""
    have = installed()
    mm = major_minor(have)
    if mm is None or mm < (0, 4):
        return needs(env_id, "0.4", have)
    return (
        f"environment {env_id!r} is a verifiers.v1 taskset/env (verifiers {have}); hpcrl does not run v1 "
        "episodes yet (verifiers' EnvServer/EnvClient path, issue 29): use a classic (0.3) env or an hpcrl Environment"
    )
