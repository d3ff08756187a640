"""scripts/bench/test_timeline.py: lanes, files and idle CPU from a test timeline, by hand."""

from __future__ import annotations

import datetime
import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "test_timeline.py"
_spec = importlib.util.spec_from_file_location("bench_test_timeline", _PATH)
tl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tl)

T0 = datetime.datetime(2026, 11, 27, 12, 0, 0, tzinfo=datetime.timezone.utc).timestamp()
ROWS = [
    {"test": "a.py::x", "worker": "gw0", "start": T0, "wall": 10.0, "cpu": 9.0},
    {"test": "a.py::y", "worker": "gw0", "start": T0 + 10, "wall": 5.0, "cpu": 1.0},
    {"test": "b.py::z", "worker": "gw1", "start": T0 + 2, "wall": 30.0, "cpu": 3.0},
]


def test_lanes_sum_wall_and_cpu_and_end_from_the_first_start() -> None:
    assert tl.lanes(ROWS) == [("gw0", 15.0, 10.0, 15.0), ("gw1", 30.0, 3.0, 32.0)]


def test_files_most_wall_first() -> None:
    assert tl.by_file(ROWS) == [("b.py", 30.0, 3.0, 1), ("a.py", 15.0, 10.0, 2)]


def test_idle_cpu_counts_samples_inside_the_window_only(tmp_path: Path) -> None:
    log = tmp_path / "cpu.log"
    # 12:00:05 is before start + 10 s; 12:00:40 after the end (T0 + 32)
    log.write_text(
        "12:00:05 busy=0% load=1\n12:00:15 busy=75% load=2\n12:00:25 busy=50% load=2\n"
        "garbage\n12:00:40 busy=0% load=1\n"
    )
    # (25 % + 50 %) of 10 s on 2 cores = 5 + 10
    assert tl.idle_cpu_s(log, T0, T0 + 32) == 15.0


def test_main_prints_every_lane_and_the_slowest_test(tmp_path: Path, capsys) -> None:
    path = tmp_path / "tl.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    tl.main([str(path), "--top", "1"])
    out = capsys.readouterr().out
    assert "gw0" in out and "gw1" in out
    assert out.rstrip().endswith("b.py::z") and "0.10" in out  # cpu/wall of the slowest test
