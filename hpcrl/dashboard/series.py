"""metrics.jsonl as curves: (step, time, value) per role and metric name, kept up to date
by reading only what was appended, and served downsampled (and smoothed) so a 10,000-step run sends
each chart at most a few hundred points.

A record is `{"role", "step", "time", "<name>": number | null, ...}` (hpcrl.monitor.metrics); extra
records (`"extra": ...`) are not curves, but `"extra": "finished"` says that role ended normally.
A null (NaN/inf when logged) is a gap in a curve, not a zero; a string or bool is not plotted.
"""

from __future__ import annotations

import threading
from array import array
from pathlib import Path
from typing import Any

from hpcrl.dashboard.tail import JsonlTail

NAN = float("nan")
_NUM = (int, float)


class Block:
    """The records of one role whose keys come in one order (a role logs the same keys every step).
    A record arrives as the list of its values (one C-level copy); on the first read after it they
    become rows of one float matrix (null -> NaN), so a curve is a column slice."""

    __slots__ = ("role", "keys", "pos", "role_pos", "pending", "mat", "seq")

    def __init__(self, role: str, keys: tuple[str, ...]):
        import numpy as np

        self.role = role
        self.role_pos = keys.index("role")
        self.keys = keys[: self.role_pos] + keys[self.role_pos + 1 :]
        self.pos = {k: i for i, k in enumerate(self.keys)}
        self.pending: list[list[Any]] = []
        self.mat = np.empty((0, len(self.keys)))
        self.seq = array("q")  # each record's number in the file: the order across blocks

    def add(self, rec: dict[str, Any], seq: int) -> None:
        vals = list(rec.values())
        del vals[self.role_pos]
        self.pending.append(vals)
        self.seq.append(seq)

    def matrix(self) -> Any:
        import numpy as np

        if self.pending:
            try:
                new = np.array(self.pending, dtype=np.float64)
            except (ValueError, TypeError):  # a string or a nested value among them: not a number
                new = np.array(
                    [[v if type(v) in _NUM else None for v in row] for row in self.pending], dtype=np.float64
                )
            self.mat = new if not len(self.mat) else np.vstack((self.mat, new))
            self.pending = []
        return self.mat

    def column(self, name: str) -> Any:
        return self.matrix()[:, self.pos[name]]

    def axes(self) -> tuple[Any, Any, Any]:
        """(seq, steps, times)."""
        import numpy as np

        m = self.matrix()
        return np.frombuffer(self.seq, np.int64, len(m)), m[:, self.pos["step"]], m[:, self.pos["time"]]


class MetricsStore:
    """The records of one run's metrics.jsonl, in blocks. `refresh()` reads what was appended (cheap
    when nothing was); every other method reads what is there."""

    def __init__(self, path: Path):
        self.tail = JsonlTail(path)
        self.lock = threading.Lock()
        self._clear()

    def _clear(self) -> None:
        self.blocks: dict[tuple[str, tuple[str, ...]], Block] = {}
        self.by_name: dict[str, list[Block]] = {}
        self.steps: dict[str, tuple[array, array]] = {}  # every record of a role: steps, times
        self.records = 0
        self.first_time: float | None = None
        self.last_time: float | None = None
        self.finished: set[str] = set()

    def refresh(self) -> None:
        with self.lock:
            recs = self.tail.poll()
            if self.tail.reset:
                self._clear()
            for rec in recs:
                self._add(rec)

    def _add(self, rec: dict[str, Any]) -> None:
        role, step, t = rec.get("role"), rec.get("step"), rec.get("time")
        if type(role) is not str or type(step) not in _NUM or type(t) not in _NUM:
            return
        if "extra" in rec:
            if rec["extra"] == "finished":
                self.finished.add(role)
            return
        keys = tuple(rec)
        b = self.blocks.get((role, keys))
        if b is None:
            b = self.blocks[(role, keys)] = Block(role, keys)
            for k, v in rec.items():
                if k not in ("role", "step", "time") and (type(v) in _NUM or v is None):
                    self.by_name.setdefault(k, []).append(b)
        b.add(rec, self.records)
        self.records += 1
        if self.first_time is None or t < self.first_time:
            self.first_time = float(t)
        if self.last_time is None or t > self.last_time:
            self.last_time = float(t)
        rs = self.steps.get(role)
        if rs is None:
            rs = self.steps[role] = (array("d"), array("d"))
        rs[0].append(step)
        rs[1].append(t)

    # -- reading -------------------------------------------------------------------------------
    def names(self) -> dict[str, list[str]]:
        """Every metric name with the roles that log it."""
        with self.lock:
            return {n: sorted({b.role for b in bs}) for n, bs in self.by_name.items()}

    def last_step(self, role_prefix: str) -> int | None:
        with self.lock:
            steps = [max(s) for r, (s, _) in self.steps.items() if r.startswith(role_prefix) and s]
        return int(max(steps)) if steps else None

    def step_times(self, role: str, last: int = 64) -> list[tuple[float, float]]:
        """(step, time) of the role's newest `last` records."""
        with self.lock:
            s, t = self.steps.get(role, ((), ()))
            return list(zip(s[-last:], t[-last:]))

    def latest(self, name: str) -> tuple[int, float] | None:
        """(step, value) of the newest finite value of `name` (any role)."""
        import numpy as np

        best: tuple[int, int, float] | None = None
        with self.lock:
            for b in self.by_name.get(name, ()):
                col = b.column(name)
                ok = np.flatnonzero(np.isfinite(col))
                if ok.size and (best is None or b.seq[ok[-1]] > best[0]):
                    j = int(ok[-1])
                    best = (b.seq[j], int(b.column("step")[j]), float(col[j]))
        return None if best is None else (best[1], best[2])

    def columns(self, name: str) -> list[tuple[str, Any, Any, Any]]:
        """(role, steps, times, values) arrays of every role that logs `name`, in file order."""
        import numpy as np

        with self.lock:
            per_role: dict[str, list[tuple[Any, Any, Any, Any]]] = {}
            for b in self.by_name.get(name, ()):
                seq, steps, times = b.axes()
                per_role.setdefault(b.role, []).append((seq, steps, times, b.column(name)))
        out = []
        for role, parts in per_role.items():
            seq, steps, times, values = (np.concatenate(x) for x in zip(*parts))
            order = np.argsort(seq, kind="stable")
            ok = np.isfinite(steps[order]) & np.isfinite(times[order])
            out.append((role, steps[order][ok], times[order][ok], values[order][ok]))
        return out


def by_step(steps: Any, values: Any) -> tuple[Any, Any]:
    """Sorted by step, the newest value kept where a step was logged twice (a resumed run re-logs
    the steps after its checkpoint)."""
    import numpy as np

    if steps.size == 0:
        return steps, values
    rev_steps = steps[::-1]
    uniq, idx = np.unique(rev_steps, return_index=True)  # first occurrence in reverse = newest
    return uniq, values[::-1][idx]


def ema(values: Any, weight: float) -> Any:
    """Debiased exponential moving average (TensorBoard's and W&B's smoothing); NaN stays a gap."""
    import numpy as np

    if weight <= 0 or values.size == 0:
        return values
    out = np.empty_like(values)
    last = 0.0
    norm = 0.0
    for i, v in enumerate(values.tolist()):
        if v != v:
            out[i] = NAN
            continue
        last = weight * last + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out[i] = last / norm
    return out


def downsample(x: Any, y: Any, points: int) -> tuple[Any, Any, Any | None, Any | None]:
    """At most `points` buckets of consecutive samples: each bucket's mean x and mean y, and its
    min and max y (so a spike the mean hides still shows). Unchanged (no band) when short enough."""
    import numpy as np

    n = x.size
    if n <= points or points < 2:
        return x, y, None, None
    starts = np.unique(np.linspace(0, n, points + 1).astype(np.int64)[:-1])
    sizes = np.diff(np.append(starts, n))
    finite = np.isfinite(y)
    counts = np.add.reduceat(finite.astype(np.int64), starts)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_y = np.add.reduceat(np.where(finite, y, 0.0), starts) / counts
        lo = np.minimum.reduceat(np.where(finite, y, np.inf), starts)
        hi = np.maximum.reduceat(np.where(finite, y, -np.inf), starts)
    empty = counts == 0
    mean_y[empty], lo[empty], hi[empty] = NAN, NAN, NAN
    mean_x = np.add.reduceat(x.astype(np.float64), starts) / sizes
    return mean_x, mean_y, lo, hi


def series(store: MetricsStore, name: str, x: str, smooth: float, points: int) -> list[dict[str, Any]]:
    """One entry per role that logs `name`: {"role", "x", "y"} (+ "lo", "hi" when downsampled).
    x is "step", "elapsed" (seconds since the run's first record) or "time" (Unix seconds)."""
    import numpy as np

    out = []
    for role, steps, times, values in store.columns(name):
        if x == "step":
            xs, ys = by_step(steps, values)
        else:
            order = np.argsort(times, kind="stable")
            xs, ys = times[order], values[order]
            if x == "elapsed":
                xs = xs - (store.first_time or 0.0)
        ys = ema(ys, smooth)
        xs, ys, lo, hi = downsample(xs, ys, points)
        entry: dict[str, Any] = {"role": role, "x": _list(xs), "y": _list(ys)}
        if lo is not None:
            entry["lo"], entry["hi"] = _list(lo), _list(hi)
        out.append(entry)
    return out


def _list(a: Any) -> list[float | None]:
    """JSON-ready: NaN/inf -> None."""
    import numpy as np

    a = np.asarray(a, dtype=np.float64)
    ok = np.isfinite(a)
    if ok.all():
        return a.tolist()
    return [v if good else None for v, good in zip(a.tolist(), ok.tolist())]
