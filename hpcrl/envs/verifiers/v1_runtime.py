"""Which verifiers 0.4 runtime a v1 env's seats run in, and whether it can start here (pure: no
verifiers import, so config validation and `--dry-run` use it in any venv).

The names are verifiers' own (`verifiers.v1.runtimes.RuntimeConfig`'s `type` values). A seat's
default is Prime's hosted sandbox; on nodes hpcrl manages, an env that keeps a hosted default runs in
the local `subprocess` runtime instead (one note), because cluster nodes rarely reach a hosted API."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping

LOCAL = ("subprocess",)
CONTAINER = {"docker": "docker", "podman": "podman", "apptainer": "apptainer"}  # runtime -> binary
HOSTED = {
    "prime": ("PRIME_API_KEY",),
    "modal": ("MODAL_TOKEN_ID", "MODAL_TOKEN_SECRET"),
    "e2b": ("E2B_API_KEY",),
}
RUNTIMES = (*LOCAL, *CONTAINER, *HOSTED)


def check_name(runtime: str) -> str | None:
    """The refusal for a runtime name verifiers does not have, else None."""
    if runtime in RUNTIMES:
        return None
    return f"{runtime!r} is not a verifiers runtime; allowed: {', '.join(RUNTIMES)}"


def cannot_start(
    runtime: str,
    environ: Mapping[str, str] | None = None,
    which: Callable[[str], str | None] = shutil.which,
) -> str | None:
    """Why `runtime` cannot start on this machine (a container binary missing from PATH, a hosted
    runtime's key missing from the environment), else None."""
    environ = os.environ if environ is None else environ
    if runtime in CONTAINER and which(CONTAINER[runtime]) is None:
        return f"runtime {runtime!r} needs `{CONTAINER[runtime]}` on PATH and it is not there"
    missing = [k for k in HOSTED.get(runtime, ()) if not environ.get(k)]
    if missing:
        return f"hosted runtime {runtime!r} needs {' and '.join(missing)} in the environment"
    return None


def effective(configured: str | None, seat_default: str) -> tuple[str, str | None]:
    """(the runtime a seat runs in, a note when hpcrl changed it): an explicit choice wins; a hosted
    default becomes `subprocess` on hpcrl-managed nodes; any other default stays."""
    if configured is not None:
        return configured, None
    if seat_default in HOSTED:
        return "subprocess", (
            f"keeps verifiers' hosted default runtime {seat_default!r}: running it in the local "
            "'subprocess' runtime (set runtime = \"...\" on the env to choose)"
        )
    return seat_default, None


def dry_run_check(cfg: object, environ: Mapping[str, str] | None = None) -> None:
    """--dry-run: every env that names a runtime can start it on this machine, else a ConfigError
    (one line) naming the env and the field."""
    from hpcrl.errors import ConfigError

    o = cfg.orchestrator  # type: ignore[attr-defined]
    lists = [("orchestrator.train.env", o.train.env)]
    if o.eval is not None:
        lists.append(("orchestrator.eval.env", o.eval.env))
    for path, envs in lists:
        for i, e in enumerate(envs):
            why = None if e.runtime is None else cannot_start(e.runtime, environ)
            if why:
                raise ConfigError(f"{path}[{i}].runtime", f"env {e.name or e.id!r}: {why}")
