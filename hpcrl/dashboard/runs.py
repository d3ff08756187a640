"""The run directories a dashboard serves, and the one check that keeps every path inside them.

A client never sends a path: it names a run by its index, and a log component, config or rollout
file by a name the server listed itself. `Run.inside` is the second line of defence: whatever path
the server is about to open must resolve (symlinks followed) under the run's real root, or it is not
opened.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.errors import UserError
from hpcrl.paths import RunPaths

# What makes a directory a run (any one of them): `hpcrl dashboard outputs/` serves every run below.
_MARKERS = ("metrics.jsonl", "configs", "logs", "job.json")


class DashboardError(UserError):
    """A command-line mistake of `hpcrl dashboard` (one line, exit 2)."""


def _is_run(d: Path) -> bool:
    return any((d / m).exists() for m in _MARKERS)


@dataclass
class Run:
    id: int
    name: str
    paths: RunPaths
    real_root: Path
    cache: dict[str, Any] = field(default_factory=dict)  # per-run indexes (series, logs, rollouts)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def inside(self, path: Path) -> Path | None:
        """`path` resolved, when it lies under this run's directory; None otherwise."""
        try:
            real = path.resolve()
        except (OSError, RuntimeError):
            return None
        return real if real == self.real_root or real.is_relative_to(self.real_root) else None

    def cached(self, key: str, make: Any) -> Any:
        with self.lock:
            if key not in self.cache:
                self.cache[key] = make()
            return self.cache[key]

    def describe(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "root": str(self.paths.root)}


def discover(dirs: list[str]) -> list[Run]:
    """One Run per directory given, or per run directory directly under it (a folder of runs)."""
    if not dirs:
        raise DashboardError("dashboard needs at least one run directory: hpcrl dashboard DIR [DIR ...]")
    found: list[Path] = []
    for d in dirs:
        p = Path(d).expanduser()
        if not p.is_dir():
            raise DashboardError(f"{d}: not a directory (give run directories, e.g. outputs/demo-rl)")
        subs = [] if _is_run(p) else sorted(s for s in p.iterdir() if s.is_dir() and _is_run(s))
        found += subs or [p]  # an empty directory may be a run that has not written anything yet
    unique: list[Path] = []
    for p in found:
        if p.resolve() not in {u.resolve() for u in unique}:
            unique.append(p)
    return [Run(i, name, RunPaths(p), p.resolve()) for i, (p, name) in enumerate(zip(unique, _names(unique)))]


def _names(paths: list[Path]) -> list[str]:
    """Short distinct names: the directory's name, with its parents added until they differ."""
    names = [p.absolute().name or str(p) for p in paths]
    depth = 1
    while len(set(names)) < len(names) and depth < 6:
        depth += 1
        names = ["/".join(p.absolute().parts[-depth:]) for p in paths]
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n}#{seen[n]}")
    return out


def pick(runs: list[Run], text: str | None, default_all: bool = False) -> list[Run]:
    """Runs named by a query value `0,2` (indexes); unknown ones are ignored. Empty: the first run
    (or all of them with `default_all`)."""
    ids: list[int] = []
    for part in (text or "").split(","):
        part = part.strip()
        if part.isdigit() and int(part) < len(runs) and int(part) not in ids:
            ids.append(int(part))
    if not ids:
        return list(runs) if default_all else runs[:1]
    return [runs[i] for i in ids]
