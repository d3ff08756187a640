"""Each role's resolved config (configs/<role>.toml, literal secrets already written as references by
the launcher), and the keys whose values differ between runs (resolved.toml, flattened)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hpcrl.dashboard.runs import Run

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

MAX_BYTES = 4 << 20  # a config file is small; anything bigger is not one


def listing(run: Run) -> dict[str, Path]:
    """name -> file of every configs/*.toml (and *.json) inside the run, resolved.toml first."""
    d = run.paths.configs_dir
    files = (
        sorted(p for p in d.glob("*") if p.suffix in (".toml", ".json") and p.is_file()) if d.is_dir() else []
    )
    files.sort(key=lambda p: (p.stem != "resolved", p.stem))
    return {p.stem if p.suffix == ".toml" else p.name: p for p in files if run.inside(p)}


def text(run: Run, name: str) -> str | None:
    path = listing(run).get(name)
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read(MAX_BYTES).decode(errors="replace")


def flat(doc: Any, prefix: str = "") -> dict[str, Any]:
    """{"trainer.optim.lr": 3e-6, ...}; a list of tables is indexed (`train.env.0.id`)."""
    out: dict[str, Any] = {}
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.update(flat(v, f"{prefix}{k}."))
    elif isinstance(doc, list) and doc and all(isinstance(v, dict) for v in doc):
        for i, v in enumerate(doc):
            out.update(flat(v, f"{prefix}{i}."))
    else:
        out[prefix[:-1]] = doc
    return out


def resolved(run: Run) -> dict[str, Any]:
    path = listing(run).get("resolved")
    if path is None:
        return {}
    try:
        return flat(tomllib.loads(path.read_text(errors="replace")))
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def diff(runs: list[Run]) -> list[dict[str, Any]]:
    """Keys of resolved.toml whose values differ between the runs: {"key", "values": [per run]}."""
    docs = [resolved(r) for r in runs]
    keys = sorted(set().union(*docs)) if docs else []
    rows = []
    for k in keys:
        vals = [d.get(k, None) for d in docs]
        if any(v != vals[0] for v in vals[1:]):
            rows.append({"key": k, "values": [None if v is None else str(v) for v in vals]})
    return rows


def max_steps(run: Run) -> int | None:
    v = resolved(run).get("max_steps")
    return int(v) if isinstance(v, int) and not isinstance(v, bool) else None
