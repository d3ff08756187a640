"""The saved rollouts of a step, as the /rollouts page asks for them: the step list (newest first
found without opening every step), a page of prompt groups with each group's rewards and advantages
(from the byte-offset index only), and the full records of the rollouts a person opens.

The files and their index are the data side's (hpcrl.monitor.rollout_files, docs/observability.md
"Saved rollouts"); this module only pages and groups.
"""

from __future__ import annotations

import math
import os
from typing import Any

from hpcrl.dashboard.runs import Run
from hpcrl.monitor import rollout_files as rf
from hpcrl.paths import RunPaths

MAX_RECORDS = 64  # records per request: a group of 64 samples, or a person's selection


def steps(run: Run) -> dict[str, Any]:
    """Every step directory under rollouts/ (one listing, cached until the directory changes), and
    the newest one with saved rollouts (checked from the newest down: a few stat() calls)."""
    d = run.paths.rollouts_dir
    try:
        mtime = os.stat(d).st_mtime_ns
    except OSError:
        return {"steps": [], "newest": None}
    hit = run.cache.get("rollout_steps")
    if hit is None or hit[0] != mtime:
        hit = run.cache["rollout_steps"] = (mtime, RunPaths.steps_in(d))
    all_steps = hit[1]
    newest = None
    for s in reversed(all_steps[-200:]):
        if _splits(run, s):
            newest = s
            break
    return {"steps": all_steps, "newest": newest}


def _splits(run: Run, step: int) -> list[str]:
    out = []
    for split in rf.SPLITS:
        f = run.paths.saved_rollouts_file(step, split)
        if f.is_file() and run.inside(f):
            out.append(split)
    return out


def _stats(values: list[float]) -> tuple[float | None, float | None]:
    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not vals:
        return None, None
    mean = sum(vals) / len(vals)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals))


def groups(
    run: Run, step: int, split: str, page: int, size: int, env: str | None, sort: str
) -> dict[str, Any]:
    """One page of the step's prompt groups (env, example), each with its rollouts' index rows."""
    available = _splits(run, step)
    if split not in available:
        split = available[0] if available else split
    idx = rf.index(run.paths.root, step, split) if split in available else None
    rows = idx.rows if idx is not None else ()
    grouped = idx.groups() if idx is not None else {}
    envs = sorted({k[0] for k in grouped})
    items = []
    for (e, example), members in grouped.items():
        if env and e != env:
            continue
        rs = [rows[i] for i in members]
        mean, std = _stats([r.reward for r in rs])
        items.append(
            {
                "env": e,
                "example_id": example,
                "mean": mean,
                "std": std,
                "errored": sum(1 for r in rs if not r.ok),
                "trained": any(r.trained for r in rs),
                "rows": [
                    {
                        "row": i,
                        "index": r.index,
                        "reward": r.reward,
                        "advantage": r.advantage,
                        "ok": r.ok,
                        "trained": r.trained,
                    }
                    for i, r in zip(members, rs)
                ],
            }
        )
    if sort in ("reward", "-reward", "std"):
        key = "std" if sort == "std" else "mean"
        sign = -1 if sort in ("-reward", "std") else 1
        items.sort(key=lambda g: (g[key] is None, sign * (g[key] or 0.0)))
    size = max(1, min(size, 200))
    pages = max(1, math.ceil(len(items) / size))
    page = max(0, min(page, pages - 1))
    return {
        "step": step,
        "split": split,
        "splits": available,
        "envs": envs,
        "rollouts": len(rows),
        "groups_total": len(items),
        "page": page,
        "pages": pages,
        "groups": items[page * size : (page + 1) * size],
    }


def records(run: Run, step: int, split: str, row_ids: list[int]) -> list[dict[str, Any]]:
    """The full records of rows `row_ids` of the step's index (at most MAX_RECORDS), in that order."""
    if split not in _splits(run, step):
        return []
    idx = rf.index(run.paths.root, step, split)
    wanted = [i for i in dict.fromkeys(row_ids) if 0 <= i < len(idx)][:MAX_RECORDS]
    if not wanted:
        return []
    recs = rf.read_rows(idx.path, [idx.rows[i] for i in wanted])
    if len(recs) != len(wanted):  # a line that did not decode: keep the row numbers honest
        return [{"row": i, **(rf.read_rows(idx.path, [idx.rows[i]]) or [{"ok": False}])[0]} for i in wanted]
    return [{"row": i, **rec} for i, rec in zip(wanted, recs)]
