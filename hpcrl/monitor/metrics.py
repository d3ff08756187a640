"""One metrics API for every role: `metrics.log(step, {...})` appends a record to metrics.jsonl.

metrics.jsonl (in the run directory) is the single source every other sink reads:

- scalar records `{"role", "step", "time", "<name>": number | null, ...}`: one per `log` call;
- extra records `{"role", "step", "time", "extra": "samples" | "distribution", ...}`: sampled
  rollouts (rows in `samples/step_N/<role>.jsonl`, named by `file`) and histograms (inline).

The launcher's console line, `hpcrl plot` and the W&B sink (`hpcrl.monitor.wandb_sink`, one writer
for all roles) all follow this file, so every role logs the same way on one machine or on SLURM, and
no role needs a network connection or a W&B handle of its own.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from hpcrl.monitor.metric_names import with_aliases
from hpcrl.paths import RunPaths
from hpcrl.storage import DEFAULT_TIMEOUT_S, Refusals

HIST_BINS = 64
EXTRA_KEY = "extra"


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


def _dumps(record: dict[str, Any]) -> bytes:
    # allow_nan=False: a NaN that slipped past _clean must fail here, not write invalid JSON.
    return (json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n").encode()


class JsonlSink:
    """Appends one line per call with a single O_APPEND write, so concurrent roles never interleave.

    A write the filesystem refuses follows the storage policy (hpcrl.storage) without blocking the
    caller: the lines wait in memory and go out, in order, at the first call after each backoff;
    named once, and WriteRefused (the role's one last line) past `timeout_s`."""

    def __init__(self, path: Path, role: str = "metrics", timeout_s: float = DEFAULT_TIMEOUT_S):
        self.path, self.role, self.timeout_s = path, role, timeout_s
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.pending: list[bytes] = []
        self._refusals: Refusals | None = None
        self._next_try = 0.0

    def write(self, record: dict[str, Any]) -> None:
        self.pending.append(_dumps(record))
        if self._refusals is not None and time.monotonic() < self._next_try:
            return
        try:
            self._flush()
        except OSError as e:
            if self._refusals is None:
                self._refusals = Refusals(
                    self.role, f"metrics ({len(self.pending)} line(s) held)", self.timeout_s, path=self.path
                )
            self._next_try = time.monotonic() + self._refusals.refused(e)
            return
        if self._refusals is not None:
            self._refusals.cleared()
            self._refusals = None

    def _flush(self) -> None:
        while self.pending:
            n = os.write(self.fd, self.pending[0])
            self.pending[0] = self.pending[0][n:]
            if not self.pending[0]:
                self.pending.pop(0)

    def close(self) -> None:
        try:
            self._flush()  # lines still held: one last try
        except OSError:
            pass  # named already; the role is ending
        os.close(self.fd)


def histogram(values: Iterable[float], bins: int = HIST_BINS) -> dict[str, Any] | None:
    """Compact summary of a distribution: count, mean, std, min, max and a fixed-bin histogram
    (`counts`, `edges`), so a record stays small however many tokens the values came from."""
    import numpy as np

    a = np.asarray(list(values) if not hasattr(values, "__array__") else values, dtype=np.float64).ravel()
    a = a[np.isfinite(a)]
    if a.size == 0:
        return None
    counts, edges = np.histogram(a, bins=bins)
    return {
        "count": int(a.size),
        "mean": float(a.mean()),
        "std": float(a.std()),
        "min": float(a.min()),
        "max": float(a.max()),
        "counts": counts.tolist(),
        "edges": edges.tolist(),
    }


class Metrics:
    """Per-process metrics logger. Only one process per role should own sinks (rank 0).

    `extras` (a `LogExtrasConfig`, normally `cfg.wandb.log_extras`) turns on sample tables and
    distributions every `extras.interval` steps; without it `log_samples`/`log_distribution` do
    nothing, so a run without W&B pays nothing for them. `wandb_run` (legacy): also log scalars to
    this W&B run directly; the W&B sink is the normal path.
    """

    def __init__(
        self,
        paths: RunPaths,
        role: str,
        enabled: bool = True,
        wandb_run: Any = None,
        extras: Any = None,
        storage_timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        self.paths = paths
        self.role = role
        self.enabled = enabled
        self.jsonl = JsonlSink(paths.metrics_file, role, storage_timeout_s) if enabled else None
        self.wandb = wandb_run
        self.extras = extras

    @classmethod
    def for_run(cls, cfg: Any, paths: RunPaths, role: str, enabled: bool = True) -> Metrics:
        """The usual construction: log extras as `cfg.<role>.wandb.log_extras` (else `cfg.wandb.log_extras`)
        says when W&B is on."""
        wandb_cfg = getattr(cfg, "wandb", None)
        timeout_s = getattr(cfg, "storage_timeout_s", DEFAULT_TIMEOUT_S)
        if wandb_cfg is None:
            return cls(paths, role, enabled=enabled, extras=None, storage_timeout_s=timeout_s)
        own = getattr(getattr(cfg, role, None), "wandb", None)
        extras = own.log_extras if own is not None and own.log_extras is not None else wandb_cfg.log_extras
        return cls(paths, role, enabled=enabled, extras=extras, storage_timeout_s=timeout_s)

    def _record(self, step: int, fields: dict[str, Any]) -> dict[str, Any]:
        return {"role": self.role, "step": int(step), "time": time.time(), **fields}

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        clean = with_aliases({k: _clean(v) for k, v in metrics.items()})
        if not self.enabled:
            return clean
        assert self.jsonl is not None
        self.jsonl.write(self._record(step, clean))
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in clean.items() if isinstance(v, (int, float))}, step=step)
        return clean

    # -- extras: sample tables and distributions ------------------------------------------------
    def samples_due(self, step: int) -> bool:
        """True when `log_samples` would write at this step: callers skip building rows otherwise."""
        e = self.extras
        return self.enabled and e is not None and e.samples and step % e.interval == 0

    def distributions_due(self, step: int) -> bool:
        e = self.extras
        return self.enabled and e is not None and e.distributions and step % e.interval == 0

    def log_samples(self, step: int, rows: Sequence[dict[str, Any]]) -> Path | None:
        """Keep `extras.sample_ratio` of `rows` (at least one; the same ones for the same step on a
        rerun) in `samples/step_N/<role>.jsonl` and point to it from metrics.jsonl. Rows are dicts
        such as {"prompt", "completion", "reward", "advantage", "env"}. No-op unless due."""
        if not rows or not self.samples_due(step):
            return None
        k = max(1, round(len(rows) * self.extras.sample_ratio))
        keep = sorted(random.Random(step).sample(range(len(rows)), min(k, len(rows))))
        path = self.paths.samples_file(step, self.role)
        from hpcrl.fileio import write_atomic

        # Written whole and renamed before the pointer exists, so a follower never reads half a table.
        write_atomic(
            path, [b"".join(_dumps({c: _clean(v) for c, v in rows[i].items()}) for i in keep)], durable=False
        )
        assert self.jsonl is not None
        rel = path.relative_to(self.paths.root).as_posix()
        self.jsonl.write(self._record(step, {EXTRA_KEY: "samples", "file": rel, "rows": len(keep)}))
        return path

    def log_distribution(self, step: int, name: str, values: Iterable[float]) -> dict[str, Any] | None:
        """A histogram of `values` (e.g. "reward", "advantage", "entropy") inline in metrics.jsonl.
        No-op unless due, or when no value is finite."""
        if not self.distributions_due(step):
            return None
        h = histogram(values)
        if h is None:
            return None
        assert self.jsonl is not None
        self.jsonl.write(self._record(step, {EXTRA_KEY: "distribution", "name": name, **h}))
        return h

    def log_finished(self, step: int) -> None:
        """This role has logged everything of its run (a normal finish): a W&B sink in another
        process keeps following metrics.jsonl until it sees this (the orchestrator's final eval
        comes after its last training record)."""
        if self.enabled:
            assert self.jsonl is not None
            self.jsonl.write(self._record(step, {EXTRA_KEY: "finished"}))

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


# -- reading ------------------------------------------------------------------------------------
def parse_lines(data: bytes) -> list[dict[str, Any]]:
    """Records of complete JSON lines; a torn or corrupt line is skipped, never fatal."""
    out = []
    for raw in data.splitlines():
        try:
            rec = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def is_extra(rec: dict[str, Any]) -> bool:
    return EXTRA_KEY in rec


def read_metrics(path: Path, extras: bool = False) -> list[dict[str, Any]]:
    """All complete records of a metrics.jsonl (a torn last line is ignored). Scalar records only
    unless `extras`."""
    if not Path(path).is_file():
        return []
    recs = parse_lines(Path(path).read_bytes())
    return recs if extras else [r for r in recs if not is_extra(r)]


class MetricsFollower:
    """Tails metrics.jsonl: each `poll()` returns the records completed since the last one.

    Only bytes up to the last newline are consumed, so a line being appended right now is read
    whole on a later poll. A file that shrank (replaced by a fresh run) is read again from 0.
    """

    def __init__(self, path: Path, offset: int = 0):
        self.path = Path(path)
        self.offset = offset

    def poll(self) -> list[dict[str, Any]]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:
            self.offset = 0
        if size == self.offset:
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(size - self.offset)
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        return parse_lines(data[: end + 1])
