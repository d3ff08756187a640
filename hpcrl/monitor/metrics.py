"""One metrics API for every role: `metrics.log(step, {...})` fans out to the sinks.

Sinks: metrics.jsonl in the run directory (one JSON object per line: role, step, time, metrics; the
launcher tails it for the console line and `hpcrl plot` reads it) and, when configured, W&B.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from hpcrl.paths import RunPaths


def _clean(v: Any) -> Any:
    """JSON-safe scalars: numpy/torch scalars become floats; NaN/inf become null."""
    if hasattr(v, "item") and callable(v.item):
        try:
            v = v.item()
        except (ValueError, RuntimeError):
            return None
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    return str(v)


class JsonlSink:
    """Appends one line per call with a single O_APPEND write, so concurrent roles never interleave."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        os.write(self.fd, (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        os.close(self.fd)


class Metrics:
    """Per-process metrics logger. Only one process per role should own sinks (rank 0)."""

    def __init__(self, paths: RunPaths, role: str, enabled: bool = True, wandb_run: Any = None):
        self.role = role
        self.enabled = enabled
        self.jsonl = JsonlSink(paths.metrics_file) if enabled else None
        self.wandb = wandb_run

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        clean = {k: _clean(v) for k, v in metrics.items()}
        if not self.enabled:
            return clean
        record = {"role": self.role, "step": step, "time": time.time(), **clean}
        assert self.jsonl is not None
        self.jsonl.write(record)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in clean.items() if isinstance(v, (int, float))}, step=step)
        return clean

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All complete records of a metrics.jsonl (a torn last line is ignored)."""
    out = []
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
