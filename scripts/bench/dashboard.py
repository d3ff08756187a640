"""`hpcrl dashboard` on a big run: a synthetic run directory of 10,000 steps (metrics.jsonl with ~60
metrics per role per step) and 1,000,000 saved rollouts (100 per step, in the documented
traces.jsonl + traces.index.json format, a multi-turn tool conversation in every other group), and
a 200,000-line orchestrator log. Measured in the server process (starlette's TestClient: the app's
own time, JSON encoding included, no network), medians over --repeat runs, in ms:

  first paint   GET / + /api/runs + /api/overview + /api/series of the overview's curves
  metrics page  /api/metric_names + one /api/series batch of 24 curves
  rollouts page /api/rollout_steps + /api/rollout_groups (newest step) + its first group's records
  older step    the same for a step in the middle of the run
  logs page     the newest 300 records of the 200,000-line log, and a search through all of it
  cold start    the first /api/overview after start (metrics.jsonl indexed from scratch)

    python scripts/bench/dashboard.py                       # ~3 min to build the run, once (reused)
    python scripts/bench/dashboard.py --steps 1000 --dir /tmp/dash-small
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from hpcrl.paths import RunPaths  # noqa: E402
from tests.dashboard_synth import write_logs, write_metrics, write_rollouts, write_state  # noqa: E402


def build(root: Path, steps: int, groups: int, size: int, log_lines: int) -> None:
    marker = root / "bench.json"
    want = {"steps": steps, "groups": groups, "size": size, "log_lines": log_lines, "format": 1}
    if marker.is_file() and json.loads(marker.read_text()) == want:
        print(f"reusing {root}")
        return
    t0 = time.perf_counter()
    paths = RunPaths(root)
    paths.make_dirs()
    write_state(paths, steps)
    write_metrics(paths, steps)
    write_logs(paths, log_lines)
    rng = random.Random(0)
    n = 0
    for s in range(1, steps + 1):
        n += write_rollouts(paths, s, "train", groups, size, rng)
        if s % 500 == 0:
            print(f"  step {s}/{steps}: {n:,} rollouts, {time.perf_counter() - t0:.0f} s", flush=True)
    marker.write_text(json.dumps(want))
    size_b = sum(p.stat().st_size for p in paths.rollouts_dir.rglob("*") if p.is_file())
    print(
        f"built {root}: {steps:,} steps, {n:,} rollouts ({size_b / 2**30:.2f} GiB), "
        f"metrics.jsonl {paths.metrics_file.stat().st_size / 2**20:.0f} MiB in {time.perf_counter() - t0:.0f} s"
    )


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/hpcrl-dashboard-bench"))
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--groups", type=int, default=10, help="prompt groups per step")
    ap.add_argument("--group-size", type=int, default=10, help="rollouts per group")
    ap.add_argument("--log-lines", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    build(args.dir, args.steps, args.groups, args.group_size, args.log_lines)

    from starlette.testclient import TestClient

    from hpcrl.dashboard.app import build_app
    from hpcrl.dashboard.runs import discover

    def client() -> TestClient:
        return TestClient(build_app(discover([str(args.dir)])), base_url="http://127.0.0.1")

    def get(c: TestClient, url: str, **params) -> dict:
        r = c.get(url, params=params)
        assert r.status_code == 200, (url, r.status_code, r.text[:300])
        return r.json() if r.headers["content-type"].startswith("application/json") else {}

    cold = []
    for _ in range(3):
        c = client()  # a fresh app: nothing indexed (no lifespan: the warm-up thread does not run)
        cold.append(timed(lambda c=c: get(c, "/api/overview")))
    c = client()
    ov = get(c, "/api/overview")["runs"][0]
    chart_names = sorted({n for ch in ov["charts"] for n in ch["names"]})
    names = sorted(get(c, "/api/metric_names")["names"])
    newest = get(c, "/api/rollout_steps")["newest"]

    def first_paint() -> None:
        get(c, "/")
        get(c, "/api/runs")
        get(c, "/api/overview")
        get(c, "/api/series", name=chart_names, x="step", points=500)

    def metrics_page() -> None:
        get(c, "/api/metric_names")
        get(c, "/api/series", name=names[:24], x="step", points=400)

    def rollouts_page(step: int) -> None:
        get(c, "/api/rollout_steps")
        g = get(c, "/api/rollout_groups", step=step, split="train", size=20)
        rows = ",".join(str(r["row"]) for r in g["groups"][0]["rows"])
        get(c, "/api/rollout_records", step=step, split="train", rows=rows)

    cases = {
        "first paint (/ + overview + 4 curves)": first_paint,
        "metrics page (names + 24 curves)": metrics_page,
        f"rollouts page, newest step {newest}": lambda: rollouts_page(newest),
        f"rollouts page, step {newest // 2}": lambda: rollouts_page(newest // 2),
        "logs page (newest 300 records)": lambda: get(c, "/api/logs", component="orchestrator", limit=300),
        "logs search through 200k lines": lambda: get(
            c, "/api/logs", component="orchestrator", q="no answer", limit=300
        ),
    }
    rows = [("cold start: first /api/overview", statistics.median(cold), max(cold))]
    for name, fn in cases.items():
        fn()  # per-step index caches warm, as for a person clicking around
        t = [timed(fn) for _ in range(args.repeat)]
        rows.append((name, statistics.median(t), max(t)))
    m = args.dir / "metrics.jsonl"
    print(
        f"\nhpcrl dashboard on {args.steps:,} steps, {args.steps * args.groups * args.group_size:,} rollouts, "
        f"metrics.jsonl {m.stat().st_size / 2**20:.0f} MiB, {len(names)} metrics ({args.repeat} runs each)\n"
    )
    w = max(len(r[0]) for r in rows)
    print(f"{'what':<{w}}  {'median ms':>9}  {'max ms':>8}")
    for name, med, mx in rows:
        print(f"{name:<{w}}  {med:>9.1f}  {mx:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
