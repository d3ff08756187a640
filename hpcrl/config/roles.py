"""What each role command reads of the run config: its `--help`, the flags it accepts, what it skips.

`hpcrl trainer | orchestrator | inference` load the whole run config (the launcher gives every role
the same resolved file, and roles read a few of each other's fields), but a user looking at one
role sees only that role's part: `hpcrl inference --help` lists the inference section, [server],
the common part of [model] and the top-level fields a server reads; a flag outside that part is
refused naming the command that reads it. A whole run file may still be given to a role command
(that is how the launchers start them): the other roles' sections in it are validated with the
run, as `hpcrl run` would, and not read.
Paths are prefixes: "trainer" is the whole section, "model.name" one field.
"""

from __future__ import annotations

_COMMON_TOP = ("deterministic", "watchdog_s", "stall_warning_s", "env_files", "log")

VIEWS: dict[str, tuple[str, ...]] = {
    "trainer": (
        *_COMMON_TOP,
        "name",
        "seed",
        "deployment",
        "type",
        "model",
        "max_steps",
        "seq_len",
        "output_dir",
        "storage_timeout_s",
        "trainer",
        "orchestrator.algo.type",
        "orchestrator.max_async_level",
        "orchestrator.policy_timeout_s",
        "ckpt",
        "wandb",
    ),
    "orchestrator": (
        *_COMMON_TOP,
        "name",
        "seed",
        "deployment",
        "model.name",
        "model.trust_remote_code",
        "max_steps",
        "seq_len",
        "output_dir",
        "storage_timeout_s",
        "orchestrator",
        "server.api_key",
        "ckpt",
        "wandb",
    ),
    "inference": (
        *_COMMON_TOP,
        "model.name",
        "model.dtype",
        "model.trust_remote_code",
        "seq_len",
        "deployment.compute",
        "inference",
        "server",
    ),
}


def reads(role: str, path: str) -> bool:
    """Does `role` read the field (or a field inside the section) at dotted `path`?"""
    return any(path == p or path.startswith(p + ".") or p.startswith(path + ".") for p in VIEWS[role])


def owner_commands(path: str) -> list[str]:
    """The role commands that read `path` (for the refusal message)."""
    return [r for r in VIEWS if reads(r, path)]
