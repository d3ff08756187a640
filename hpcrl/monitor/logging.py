"""One logging setup for every role: `HH:MM:SS LEVEL [role] message`, to the console and a log file."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from hpcrl.storage import TolerantFileHandler, TolerantStreamHandler, raw_stream, tolerate_std_streams

_FMT = "%(asctime)s %(levelname)-7s [%(role)s] %(message)s"


class _RoleFilter(logging.Filter):
    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def filter(self, record: logging.LogRecord) -> bool:
        record.role = self.role
        return True


# The level env servers and their workers log at (orchestrator.log.vf_level): set by the orchestrator,
# inherited by the env processes it starts.
ENV_LEVEL_VAR = "HPCRL_VF_LOG_LEVEL"


def resolve_level(level: str | None) -> int:
    """The level given, else $HPCRL_LOG_LEVEL, else prime-rl's $PRIME_LOG_LEVEL, else info."""
    env = os.environ.get("HPCRL_LOG_LEVEL") or os.environ.get("PRIME_LOG_LEVEL")
    name = (level or env or "info").upper()
    value = logging.getLevelName(name)
    if not isinstance(value, int):
        raise ValueError(f"log level '{level}': expected debug, info, warning or error")
    return value


def setup_logging(
    role: str, level: str | None = None, log_file: str | Path | None = None, console: bool = True
) -> logging.Logger:
    """Configure the root logger for one process; returns the `hpcrl` logger. From here on, output
    the filesystem refuses is dropped and counted, never raised (hpcrl.storage.tolerate_std_streams)."""
    tolerate_std_streams()
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    lvl = resolve_level(level)
    root.setLevel(lvl)
    fmt = logging.Formatter(_FMT, datefmt="%H:%M:%S")
    role_filter = _RoleFilter(role)
    handlers: list[logging.Handler] = []
    if console:
        handlers.append(TolerantStreamHandler(raw_stream(sys.stderr)))  # its own lost-lines note
    if log_file is not None:
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        handlers.append(TolerantFileHandler(log_file))
    for h in handlers:
        h.setFormatter(fmt)
        h.addFilter(role_filter)
        root.addHandler(h)
    # Third-party chatter stays at warning unless we debug.
    for noisy in ("httpx", "httpcore", "urllib3", "uvicorn.access", "filelock"):
        logging.getLogger(noisy).setLevel(max(lvl, logging.WARNING))
    return logging.getLogger("hpcrl")


def env_process_level() -> int:
    """The level of an env server / worker process: $HPCRL_VF_LOG_LEVEL (orchestrator.log.vf_level)."""
    return resolve_level(os.environ.get(ENV_LEVEL_VAR))


def env_logger(env_name: str) -> logging.Logger:
    """Where an environment's own events go (errored rollouts, env warnings): logs/envs/<kind>/<env>.log
    once attach_env_logs ran, and the role's log too (propagation)."""
    return logging.getLogger(f"hpcrl.envs.{env_name}")


def attach_env_logs(
    files: dict[str, list[Path]], vf_level: str = "warning", verifiers_envs: tuple[str, ...] = ()
) -> None:
    """One file per (kind, env): `files` maps env name -> its log files (train and/or eval). Envs
    written for verifiers also get verifiers' own log lines, at `vf_level`."""
    fmt = logging.Formatter("%(asctime)s %(levelname)-7s [%(name)s] %(message)s", datefmt="%H:%M:%S")
    vf = logging.getLogger("verifiers")
    vf.setLevel(resolve_level(vf_level))
    for name, paths in files.items():
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            handler = TolerantFileHandler(path)  # a log the disk refuses never ends a role
            handler.setFormatter(fmt)
            env_logger(name).addHandler(handler)
            if name in verifiers_envs:
                vf.addHandler(handler)
