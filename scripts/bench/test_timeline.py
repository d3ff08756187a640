"""Where the test suite's time goes: which tests compute and which wait, per worker, from a timeline.

    HPCRL_TEST_TIMELINE=/tmp/tl.jsonl bash scripts/test.sh        # one JSON line per test (tests/conftest.py)
    python scripts/bench/test_timeline.py /tmp/tl.jsonl [--top 25] [--cpu-log FILE]

Prints, per lane (an xdist worker, or `main`: the waiting lane and the side checks' pytest runs), its
tests' wall and CPU seconds and its end; then the files and the tests that take the most wall time,
with CPU/wall (CPU: the test process and the children it reaped; ranks forked from the zygote,
shared servers and SLURM jobs are not counted). A test far below 1.0 waits; `waits` in
pyproject.toml's markers says what scripts/test.sh does with such tests.

--cpu-log: the machine's busy % every 10 s (lines "HH:MM:SS busy=NN% ..."), to add the idle CPU
seconds while the suite ran.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
from pathlib import Path
from typing import Any


def load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def lanes(rows: list[dict[str, Any]]) -> list[tuple[str, float, float, float]]:
    """(lane, wall, cpu, end in s from the first start) per lane, sorted by lane."""
    t0 = min(r["start"] for r in rows)
    out = []
    for lane in sorted({r["worker"] for r in rows}):
        rs = [r for r in rows if r["worker"] == lane]
        end = max(r["start"] + r["wall"] for r in rs) - t0
        out.append((lane, sum(r["wall"] for r in rs), sum(r["cpu"] for r in rs), end))
    return out


def by_file(rows: list[dict[str, Any]]) -> list[tuple[str, float, float, int]]:
    """(file, wall, cpu, tests), most wall first."""
    acc: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for r in rows:
        a = acc[r["test"].split("::")[0]]
        a[0] += r["wall"]
        a[1] += r["cpu"]
        a[2] += 1
    return sorted(((f, w, c, int(n)) for f, (w, c, n) in acc.items()), key=lambda x: -x[1])


def idle_cpu_s(cpu_log: Path, start: float, end: float, cores: int = 2, every_s: float = 10.0) -> float:
    """Idle CPU seconds between two times (epoch s) from a busy-% log stamped HH:MM:SS (UTC, the day
    of `start`)."""
    day = datetime.datetime.fromtimestamp(start, datetime.timezone.utc).date()
    idle = 0.0
    for line in cpu_log.read_text().splitlines():
        parts = line.split()
        if len(parts) < 2 or not parts[1].startswith("busy="):
            continue
        hms = datetime.time.fromisoformat(parts[0])
        t = datetime.datetime.combine(day, hms, datetime.timezone.utc).timestamp()
        if start + every_s <= t <= end:
            idle += (100 - int(parts[1][5:].rstrip("%"))) / 100 * every_s * cores
    return idle


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("timeline", type=Path)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--cpu-log", type=Path)
    a = ap.parse_args(argv)
    rows = load(a.timeline)
    print(f"{'lane':<6} {'tests':>6} {'wall s':>8} {'cpu s':>8} {'end s':>7}")
    for lane, wall, cpu, end in lanes(rows):
        n = sum(r["worker"] == lane for r in rows)
        print(f"{lane:<6} {n:>6} {wall:>8.0f} {cpu:>8.0f} {end:>7.0f}")
    if a.cpu_log:
        start = min(r["start"] for r in rows)
        end = max(r["start"] + r["wall"] for r in rows)
        print(f"idle CPU while the suite ran: {idle_cpu_s(a.cpu_log, start, end):.0f} CPU-s")
    print(f"\n{'wall s':>8} {'cpu s':>8} {'tests':>6}  file")
    for f, wall, cpu, n in by_file(rows)[: a.top]:
        print(f"{wall:>8.0f} {cpu:>8.0f} {n:>6}  {f}")
    print(f"\n{'wall s':>8} {'cpu/wall':>8}  lane   test")
    for r in sorted(rows, key=lambda r: -r["wall"])[: a.top]:
        ratio = r["cpu"] / r["wall"] if r["wall"] else 0.0
        print(f"{r['wall']:>8.1f} {ratio:>8.2f}  {r['worker']:<6} {r['test'][:110]}")


if __name__ == "__main__":
    main()
