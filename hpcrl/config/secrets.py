"""Secrets: they reach processes through their environment and never through files in the run dir.

Three ways a secret gets to an environment's `load_environment()` (or any role):
- an env_file (`env_file = ["secrets.env"]`, native `env_files`): KEY=VALUE lines loaded into the
  environment of every process that loads the config (launcher, trainer, orchestrator, inference),
  locally and on SLURM nodes (the file is read where the process runs; only its path is recorded);
- a reference in a config value, `"${env:NAME}"`, resolved in the process that uses the value (env
  args: hpcrl.envs.registry), never substituted into a config file;
- a literal value under a secret-looking key (`api_key = "sk-..."`): the launcher moves it into the
  children's environment as HPCRL_SECRET_<PATH> and writes the reference `${env:HPCRL_SECRET_<PATH>}`
  in the run's config files instead. Such a value exists only in process environments, so
  `hpcrl resume` of that run needs it exported again (the error names the variable) — or use an
  env_file.

Redaction (hpcrl.config.resolved.redact) is only for what people read: logs, summaries, W&B.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpcrl.errors import ConfigError

ENV_REF_RE = re.compile(r"\$\{env:([A-Za-z_][A-Za-z0-9_]*)\}")
SECRET_ENV_PREFIX = "HPCRL_SECRET_"
_SECRET_KEY_RE = re.compile(
    r"(api_?key|secret|password|passwd|auth_key|access_token|auth_token|api_token|hf_token|^token)$",
    re.IGNORECASE,
)
# Secrets inside free-form strings (slurm.setup lines, env args): `export HF_TOKEN=hf_...`.
INLINE_SECRET_RE = re.compile(
    r"(\b[A-Za-z0-9_]*(?:API_KEY|APIKEY|TOKEN|SECRET|PASSWORD|AUTH_KEY)\s*[=:]\s*)(['\"]?)[^\s'\"]+\2",
    re.IGNORECASE,
)
KEY_PREFIX_RE = re.compile(
    r"\b(?:sk-[A-Za-z0-9_\-]{16,}|hf_[A-Za-z0-9]{16,}|tskey-[A-Za-z0-9\-]{8,}|wandb_v1_\w{16,})"
)


def is_secret_key(key: str) -> bool:
    """A key whose value is a secret (`*_var` keys name a variable and are not secret)."""
    return bool(key) and not key.endswith("_var") and bool(_SECRET_KEY_RE.search(key))


def is_ref(value: Any) -> bool:
    """A string that is exactly one `${env:NAME}` reference."""
    return isinstance(value, str) and ENV_REF_RE.fullmatch(value) is not None


def looks_secret(key: str, value: Any) -> bool:
    """Does this config value hold a secret literally (not through a reference)?"""
    if not isinstance(value, str) or not value or is_ref(value):
        return False
    if is_secret_key(key):
        return True
    bare = ENV_REF_RE.sub("", value)  # `Bearer ${env:X}` holds no literal secret
    return bool(INLINE_SECRET_RE.search(bare) or KEY_PREFIX_RE.search(bare))


def secret_var(path: str) -> str:
    """The environment variable a literal secret at dotted `path` travels in."""
    return SECRET_ENV_PREFIX + re.sub(r"[^A-Z0-9]+", "_", path.upper()).strip("_")


def externalize(d: Any, path: str = "", key: str = "") -> tuple[Any, dict[str, str]]:
    """Replace every literal secret in a plain config dict by `${env:HPCRL_SECRET_<PATH>}`.
    Returns (the dict safe to write, {variable: value} for the children's environment)."""
    env: dict[str, str] = {}
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out[k], sub = externalize(v, f"{path}.{k}" if path else str(k), str(k))
            env.update(sub)
        return out, env
    if isinstance(d, list):
        items = []
        for i, v in enumerate(d):
            item, sub = externalize(v, f"{path}[{i}]", key)
            items.append(item)
            env.update(sub)
        return items, env
    if looks_secret(key, d):
        var = secret_var(path)
        return f"${{env:{var}}}", {var: d}
    return d, env


def resolve_refs(value: Any, path: str, environ: Mapping[str, str] | None = None) -> Any:
    """Substitute `${env:NAME}` references (recursively) from the process environment.
    A missing variable is a ConfigError naming the field and the variable."""
    environ = os.environ if environ is None else environ
    if isinstance(value, dict):
        return {k: resolve_refs(v, f"{path}.{k}", environ) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_refs(v, f"{path}[{i}]", environ) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${env:" not in value:
        return value

    def one(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in environ:
            raise _unset(path, name)
        return environ[name]

    return ENV_REF_RE.sub(one, value)


def _unset(path: str, name: str) -> ConfigError:
    hint = (
        "it held a literal secret that is never written to disk: export it again, or move the "
        "value to an env_file"
        if name.startswith(SECRET_ENV_PREFIX)
        else "export it or add it to an env_file"
    )
    return ConfigError(path, f"references ${{env:{name}}} but {name} is not set ({hint})")


def check_secret_refs(value: Any, environ: Mapping[str, str], path: str = "") -> None:
    """ConfigError for the first `${env:HPCRL_SECRET_...}` reference whose variable `environ` lacks.
    Such a variable only ever existed in the environment of the launch that externalized it, so a
    later launch (`hpcrl resume` of a SLURM run) must have it again; checked before submitting, since
    on the nodes the job would only fail (and requeue) later. Other references may be set on the nodes."""
    if isinstance(value, dict):
        for k, v in value.items():
            check_secret_refs(v, environ, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_secret_refs(v, environ, f"{path}[{i}]")
    elif isinstance(value, str):
        for m in ENV_REF_RE.finditer(value):
            if m.group(1).startswith(SECRET_ENV_PREFIX) and m.group(1) not in environ:
                raise _unset(path, m.group(1))


def read_env_file(path: Path, where: str) -> dict[str, str]:
    """KEY=VALUE lines (blank lines, `#` comments and a leading `export ` allowed; quotes stripped)."""
    try:
        if not path.is_file():
            raise ConfigError(where, f"'{path}' not found")
        text = path.read_text()
    except OSError as e:  # a file the user named: unreadable is theirs to fix, in one line
        raise ConfigError(where, f"'{path}' cannot be read ({e.strerror})") from None
    except UnicodeDecodeError:
        raise ConfigError(where, f"'{path}' is not a UTF-8 text file of KEY=VALUE lines") from None
    out: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        k, eq, v = line.partition("=")
        k = k.strip().removeprefix("export ").strip()
        if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
            raise ConfigError(where, f"{path} line {n}: expected KEY=VALUE")
        v = v.strip()
        if len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
            v = v[1:-1]
        out[k] = v
    return out


def load_env_files(paths: list[str]) -> dict[str, str]:
    """Load env_files into this process's environment. A variable already set in the environment
    wins (as with docker / python-dotenv), so `OPENAI_API_KEY=... hpcrl run` overrides the file."""
    loaded: dict[str, str] = {}
    for i, p in enumerate(paths):
        loaded.update(read_env_file(Path(p), f"env_files[{i}]"))
    for k, v in loaded.items():
        os.environ.setdefault(k, v)
    return loaded
