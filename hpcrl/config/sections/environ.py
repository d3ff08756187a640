"""`env_vars` tables (prime-rl's): extra environment variables for the processes a run starts.

    env_vars = {...}                top level: every process of the run
    [trainer.env_vars]              the trainer ranks          (over the top level, key by key)
    [orchestrator.env_vars]         the orchestrator and its env servers
    [inference.env_vars]            the inference servers

Values are strings; a value may be (or hold) a `${env:NAME}` reference, resolved from the launcher's
environment (locally) or the batch shell's (SLURM), so a secret need not be written in the config. A
literal secret (a secret-looking name such as OPENAI_API_KEY, or a value such as `sk-...`) is written
to configs/ as a reference and travels in process environments only (hpcrl.config.secrets). The
launcher applies the tables to the processes it starts (`resolved` locally, `for_script` in the
rendered SLURM script), and `hpcrl inference` applies its own in-process as well (prime-rl's standalone
server does); the variables the launcher manages itself cannot be set.

    resolved(cfg, "trainer")     {NAME: value} for a process started on this machine: the top-level
                                 table under the role's, references resolved from this environment
                                 (an unset one is a ConfigError naming the key)
    for_script(cfg, "trainer")   the same table for a rendered SLURM script: literal secrets become
                                 `${env:HPCRL_SECRET_...}` references (their values reach the job in
                                 sbatch's environment), and the script expands every reference in the
                                 batch shell (hpcrl.launch.hetjob)

Kinds: trainer, orchestrator (and "envs": the env servers, which are the orchestrator's), inference.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, TypeAlias

from msgspec import Meta

from hpcrl.config import secrets
from hpcrl.errors import ConfigError

ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"

EnvVars: TypeAlias = dict[Annotated[str, Meta(pattern=ENV_NAME)], str | int | float]
"""A process-environment table: shell variable names to values, strings (a TOML number such as
`OMP_NUM_THREADS = 4` is taken as its text when the config is checked)."""

# Set by the launcher for each process (GPU binding, ranks, the run's directory and key, SLURM's own):
# an env_vars entry would be overwritten, or would break the placement. prime-rl refuses its own set
# (CUDA_VISIBLE_DEVICES, its run id and shared-W&B variables) the same way.
PROTECTED = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "VLLM_API_KEY",
        "PRL_RUN_ID",
        "PRL_RUN_NAME",
        "WANDB_RUN_ID",
        "WANDB_SHARED_MODE",
        "WANDB_SHARED_LABEL",
        "WANDB_SHARED_PRIMARY",
        "WANDB_SHARED_FINISHER",
    }
)
PROTECTED_PREFIXES = ("HPCRL_", "SLURM_", "SRUN_", "SBATCH_")
# Variables a config key sets (one home): the key, not env_vars, decides them.
OWNED_BY_KEYS = {
    "VLLM_USE_DEEP_GEMM": "inference.use_deep_gemm",
    "VLLM_MOE_USE_DEEP_GEMM": "inference.use_deep_gemm",
}


def check_env_vars(table: dict[str, str | int | float], path: str) -> None:
    """ConfigError for a variable the launcher or another key owns, or a value no process can hold;
    numbers become their text, in place."""
    for name, value in list(table.items()):
        where = f"{path}.{name}"
        if not isinstance(value, str):
            table[name] = value = str(value)
        if name in PROTECTED or name.startswith(PROTECTED_PREFIXES):
            raise ConfigError(where, "is set by hpcrl's launcher for each process and cannot be set here")
        if name in OWNED_BY_KEYS:
            raise ConfigError(where, f"is set by {OWNED_BY_KEYS[name]}; set that key instead")
        if "\x00" in value:
            raise ConfigError(where, "holds a NUL character, which no environment variable can")


def check_config(cfg: object) -> None:
    """Every env_vars table of an RL config (hpcrl.config.validate)."""
    tables = [("env_vars", getattr(cfg, "env_vars", {}))]
    for role in ("trainer", "orchestrator", "inference"):
        section = getattr(cfg, role, None)
        if section is not None and hasattr(section, "env_vars"):
            tables.append((f"{role}.env_vars", section.env_vars))
    deployment = getattr(getattr(cfg, "inference", None), "deployment", None)
    for part in ("prefill_env_vars", "decode_env_vars"):
        if deployment is not None:
            tables.append((f"inference.deployment.{part}", getattr(deployment, part)))
    for path, table in tables:
        check_env_vars(table, path)


# The role whose table a process kind reads.
ROLE_OF = {
    "trainer": "trainer",
    "orchestrator": "orchestrator",
    "envs": "orchestrator",
    "inference": "inference",
}


def _tables(cfg: object, kind: str) -> list[tuple[str, Mapping[str, str]]]:
    """(dotted path, table) from the weakest to the strongest (the role's wins, key by key)."""
    tables: list[tuple[str, Mapping[str, str]]] = [("env_vars", getattr(cfg, "env_vars", {}) or {})]
    role = ROLE_OF.get(kind)
    section = getattr(cfg, role, None) if role else None
    if section is not None and getattr(section, "env_vars", None):
        tables.append((f"{role}.env_vars", section.env_vars))
    return tables


def resolved(cfg: object, kind: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables `kind`'s process gets on this machine, references resolved."""
    out: dict[str, str] = {}
    for path, table in _tables(cfg, kind):
        for name, value in table.items():
            out[name] = secrets.resolve_refs(value, f"{path}.{name}", environ)
    return out


def for_script(cfg: object, kind: str) -> dict[str, str]:
    """The variables `kind`'s step gets on SLURM, with every secret as a `${env:...}` reference."""
    out: dict[str, str] = {}
    for path, table in _tables(cfg, kind):
        out.update(secrets.externalize(dict(table), path)[0])
    return out
