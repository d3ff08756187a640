"""What the overview page says of one run: the job, each role's state from its progress file
(running, stalled, unresponsive when its report went stale), whom a stalled role waits on, the top
causes of errored rollouts, the step and an ETA, the newest reward and eval figures, and the recent
WARNING/ERROR lines of the roles' logs."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from hpcrl.dashboard import configs
from hpcrl.dashboard.logs import recent_problems
from hpcrl.dashboard.runs import Run
from hpcrl.dashboard.series import MetricsStore
from hpcrl.launch.stallview import read_causes
from hpcrl.monitor.progress import STALE_S, read_progress

# Curves on the overview, by name pattern (`*` is one path part); the first that exists is drawn.
CHARTS = (
    ("reward", ("reward/all/mean", "reward/mean")),
    ("eval", ("eval/*/avg@*", "eval/*/reward", "val/*/reward")),
    ("loss", ("loss/mean",)),
    ("throughput (tokens/s)", ("perf/throughput",)),
)


def job_state(run: Run, store: MetricsStore) -> tuple[dict[str, Any], str]:
    try:
        job = json.loads(run.paths.job_file.read_text())
    except (OSError, ValueError):
        job = {}
    if not isinstance(job, dict):
        job = {}
    # the orchestrator logs "finished" after its final eval (the last thing of an RL run); SFT has
    # only a trainer
    finished = "orchestrator" in store.finished or (
        "trainer" in store.finished and "orchestrator" not in store.steps
    )
    if job.get("target") == "slurm":
        state = "finished" if finished else f"SLURM job {job.get('job_id', '?')}"
    elif job.get("pid"):
        state = "running" if _alive(job["pid"]) else ("finished" if finished else "not running")
    else:
        state = "finished" if finished else "unknown"
    return job, state


def _alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
        return True
    except (OSError, ValueError):
        return False


def roles(run: Run, running: bool) -> list[dict[str, Any]]:
    rows = []
    for r in read_progress(run.paths.progress_dir):
        state = r.get("state", "?")
        if r["age_s"] > STALE_S:
            state = "unresponsive" if running else "exited"
        rows.append(
            {
                "role": r.get("role"),
                "state": state,
                "step": r.get("step"),
                "last": r.get("last"),
                "idle_s": r.get("idle_s"),
                "age_s": round(r["age_s"], 1),
                "waiting_on": r.get("waiting_on") if state != "exited" else None,
                "waiting_s": r.get("waiting_s"),
                "stall": r.get("stall") if state in ("stalled", "unresponsive") else None,
                "servers": [
                    {"name": n, "state": s, "inflight": (r.get("inflight") or {}).get(n)}
                    for n, s in (r.get("servers") or {}).items()
                ],
            }
        )
    return rows


def eta(store: MetricsStore, step: int | None, max_steps: int | None, running: bool) -> float | None:
    """Seconds to max_steps at the pace of the newest trainer steps (this session's: a long gap, a
    resume, does not count)."""
    if not running or step is None or not max_steps or step >= max_steps:
        return None
    pts = store.step_times("trainer")
    if len(pts) < 2:
        return None
    gaps = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in zip(pts, pts[1:]) if s1 > s0]
    if not gaps:
        return None
    gaps.sort()
    per_step = gaps[len(gaps) // 2]
    return round(per_step * (max_steps - step), 1)


def chart_names(names: dict[str, list[str]]) -> list[dict[str, Any]]:
    out = []
    for title, patterns in CHARTS:
        for pat in patterns:
            hits = sorted(n for n in names if _match(pat, n))
            if hits:
                out.append({"title": title, "names": hits[:8]})
                break
    return out


def _match(pattern: str, name: str) -> bool:
    pp, nn = pattern.split("/"), name.split("/")
    if len(pp) != len(nn):
        return False
    for p, n in zip(pp, nn):
        if p == "*":
            continue
        if p.endswith("*") and n.startswith(p[:-1]):
            continue
        if p != n:
            return False
    return True


def overview(run: Run, store: MetricsStore) -> dict[str, Any]:
    store.refresh()
    job, state = job_state(run, store)
    running = state == "running" or state.startswith("SLURM")
    steps = configs.max_steps(run)
    trainer = store.last_step("trainer")
    names = store.names()
    latest = {}
    for n in ["reward/all/mean", "loss/mean", *sorted(n for n in names if n.startswith("eval/"))][:10]:
        v = store.latest(n)
        if v is not None:
            latest[n] = {"step": v[0], "value": v[1]}
    return {
        "run": run.describe(),
        "job": {"target": job.get("target"), "id": job.get("job_id", job.get("pid")), "state": state},
        "step": trainer,
        "orchestrator_step": store.last_step("orchestrator"),
        "max_steps": steps,
        "eta_s": eta(store, trainer, steps, running),
        "updated_s": None if store.last_time is None else round(time.time() - store.last_time, 1),
        "roles": roles(run, running),
        "causes": [{"env": e, "cause": c, "count": n} for e, c, n in read_causes(run.paths.causes_file)[:5]],
        "problems": recent_problems(run),
        "latest": latest,
        "charts": chart_names(names),
    }
