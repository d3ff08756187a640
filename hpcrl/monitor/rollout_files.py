"""Reading the saved rollouts of a run: `rollouts/step_N/{train,eval}/traces.jsonl`.

The orchestrator writes each step's file whole (hpcrl.orchestrator.rollout_log): the records, then
`traces.index.json` beside it, both atomically, so a reader sees a whole file or the previous one.
The index holds each record's byte offset and length plus a one-line summary (env, example, rollout
index in its group, reward, advantage, ok, trained), so a page lists a step's rollouts, groups them
by prompt and fetches records k..k+n without reading the rest of the file. A file without a matching
index (an older writer, a copy, an index not renamed yet) is indexed by scanning it once; a line
without its newline (a torn write) or one that is not JSON is skipped. Indexes are cached by
(path, size, mtime), so a page polled every second costs one stat() per file.

Stdlib only (floor 1): the dashboard, `hpcrl status` and tests import it without numpy or torch.

    from hpcrl.monitor import rollout_files as rf
    rf.steps(run_dir)                         # [1, 2, ...]: steps with saved rollouts
    rf.splits(run_dir, 12)                    # ["eval", "train"]
    idx = rf.index(run_dir, 12, "train")      # idx.rows[i]: RowSummary; len(idx)
    rf.read(run_dir, 12, "train", 40, 20)     # records 40..59 (dicts)
    for rec in rf.iter_records(run_dir, 12, "train"): ...
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.paths import RunPaths

SPLITS = ("train", "eval")
INDEX_FORMAT = 1
# The index's row layout (traces.index.json "columns"): one list per record in this order.
COLUMNS = ("offset", "length", "env", "example_id", "index", "reward", "advantage", "ok", "trained")
_CACHE_SIZE = 64


@dataclass(frozen=True)
class RowSummary:
    """One saved rollout as the index describes it (enough to list and group without the record)."""

    offset: int  # byte offset of its line in traces.jsonl
    length: int  # bytes of the line, newline included
    env: str
    example_id: int
    index: int  # rollout index inside its group (the group: env + example_id)
    reward: float | None
    advantage: float | None  # None: the group was never judged (every rollout errored)
    ok: bool
    trained: bool  # train: in the step's batch; False: dropped by a filter. eval: always False


@dataclass(frozen=True)
class RolloutIndex:
    path: Path  # the traces.jsonl it describes
    size: int  # bytes of traces.jsonl it covers
    rows: tuple[RowSummary, ...]

    def __len__(self) -> int:
        return len(self.rows)

    def groups(self) -> dict[tuple[str, int], list[int]]:
        """(env, example_id) -> row numbers of that group's rollouts, in file order."""
        out: dict[tuple[str, int], list[int]] = {}
        for i, r in enumerate(self.rows):
            out.setdefault((r.env, r.example_id), []).append(i)
        return out


def steps(run_dir: str | Path) -> list[int]:
    """Steps that have saved rollouts (train or eval), ascending."""
    paths = RunPaths(run_dir)
    return [s for s in RunPaths.steps_in(paths.rollouts_dir) if splits(run_dir, s)]


def splits(run_dir: str | Path, step: int) -> list[str]:
    """The splits saved for `step`, of SPLITS."""
    paths = RunPaths(run_dir)
    return [s for s in SPLITS if paths.saved_rollouts_file(step, s).is_file()]


def index(run_dir: str | Path, step: int, split: str) -> RolloutIndex:
    """The index of one step's file (empty when there is none yet)."""
    paths = RunPaths(run_dir)
    return index_of(paths.saved_rollouts_file(step, split), paths.saved_rollouts_index(step, split))


def read(run_dir: str | Path, step: int, split: str, start: int = 0, count: int | None = None) -> list[dict]:
    """Records start..start+count-1 of one step and split (fewer at the end; [] past it). Only
    those bytes are read."""
    idx = index(run_dir, step, split)
    rows = idx.rows[max(0, start) : None if count is None else max(0, start) + max(0, count)]
    return read_rows(idx.path, rows)


def iter_records(run_dir: str | Path, step: int, split: str) -> Iterator[dict]:
    """Every record of one step and split, in file order; bad or torn lines skipped."""
    path = RunPaths(run_dir).saved_rollouts_file(step, split)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    for _, line in _lines(data):
        rec = _decode(line)
        if rec is not None:
            yield rec


def read_rows(path: Path, rows: tuple[RowSummary, ...] | list[RowSummary]) -> list[dict]:
    """The records of `rows` (from index_of(path)): one read of the byte span they cover."""
    if not rows:
        return []
    lo = min(r.offset for r in rows)
    hi = max(r.offset + r.length for r in rows)
    try:
        with open(path, "rb") as f:
            f.seek(lo)
            data = f.read(hi - lo)
    except FileNotFoundError:
        return []
    out = []
    for r in rows:
        rec = _decode(data[r.offset - lo : r.offset - lo + r.length])
        if rec is not None:
            out.append(rec)
    return out


# -- the index --------------------------------------------------------------------------------------
_cache: OrderedDict[tuple[str, int, int], RolloutIndex] = OrderedDict()


def index_of(path: Path, index_path: Path) -> RolloutIndex:
    """The index of `path`: its sidecar when that covers exactly this file, else a scan; cached."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return RolloutIndex(path, 0, ())
    key = (str(path), st.st_size, st.st_mtime_ns)
    hit = _cache.get(key)
    if hit is not None:
        _cache.move_to_end(key)
        return hit
    idx = _load_sidecar(path, index_path, st.st_size) or scan(path)
    _cache[key] = idx
    while len(_cache) > _CACHE_SIZE:
        _cache.popitem(last=False)
    return idx


def _load_sidecar(path: Path, index_path: Path, size: int) -> RolloutIndex | None:
    try:
        doc = json.loads(index_path.read_bytes())
        if doc.get("format") != INDEX_FORMAT or doc.get("size") != size:
            return None  # not this file's index (older, newer, or another writer's)
        cols = doc["columns"]
        rows = tuple(summary_of_row(dict(zip(cols, row))) for row in doc["rows"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return RolloutIndex(path, size, rows)


def scan(path: Path) -> RolloutIndex:
    """Index a file by reading it once (no sidecar, or one that does not match)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return RolloutIndex(path, 0, ())
    rows = []
    for offset, line in _lines(data):
        rec = _decode(line)
        if rec is not None:
            rows.append(summary_of(rec, offset, len(line)))
    return RolloutIndex(path, len(data), tuple(rows))


def summary_of(rec: dict[str, Any], offset: int, length: int) -> RowSummary:
    """A record's index row (the writer builds its sidecar with this too)."""
    env = rec.get("env")
    group = rec.get("group") or {}
    task = rec.get("task") or {}
    return RowSummary(
        offset=offset,
        length=length,
        env=str(env.get("name", "") if isinstance(env, dict) else env or ""),
        example_id=int(task.get("example_id", -1)),
        index=int(group.get("index", 0)),
        reward=rec.get("reward"),
        advantage=rec.get("advantage"),
        ok=bool(rec.get("ok", False)),
        trained=bool(rec.get("trained", False)),
    )


def row_of(s: RowSummary) -> list[Any]:
    """A RowSummary as one row of the sidecar (COLUMNS order)."""
    return [getattr(s, c) for c in COLUMNS]


def summary_of_row(d: dict[str, Any]) -> RowSummary:
    return RowSummary(**{c: d[c] for c in COLUMNS})


def _lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(offset, line with its newline) of every complete line; a last line without one is torn."""
    pos = 0
    while True:
        end = data.find(b"\n", pos)
        if end < 0:
            return
        if end > pos:
            yield pos, data[pos : end + 1]
        pos = end + 1


def _decode(line: bytes) -> dict | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def clear_cache() -> None:
    _cache.clear()


def file_size(run_dir: str | Path, step: int, split: str) -> int:
    """Bytes of one step's saved rollouts (records + index), 0 when none."""
    paths = RunPaths(run_dir)
    total = 0
    for p in (paths.saved_rollouts_file(step, split), paths.saved_rollouts_index(step, split)):
        try:
            total += os.stat(p).st_size
        except FileNotFoundError:
            pass
    return total
