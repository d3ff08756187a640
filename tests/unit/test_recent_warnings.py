"""A process replaced in turn is a new event on the console, and `hpcrl status` keeps the newest
distinct warnings of the roles' logs (hpcrl.launch.alerts.recent_warnings)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from hpcrl.launch.alerts import PID_GAP_S, Alerts, recent_warnings
from hpcrl.launch.logview import records
from hpcrl.paths import RunPaths

DIED = "{t} WARNING [orchestrator] env train/x: env worker 0 (pid {pid}) died: killed by signal 9 (SIGKILL)"


def _printed(lines: list[str]) -> list[str]:
    a = Alerts()
    return [out for r in records(lines) if (out := a.see(r)) is not None]


def test_a_line_naming_a_new_process_is_printed_with_its_own_figures() -> None:
    assert PID_GAP_S == 10
    out = _printed(
        [
            DIED.format(t="12:00:00", pid=100),
            DIED.format(t="12:00:30", pid=100),  # the same process again: a repeat
            DIED.format(t="12:00:31", pid=200),  # its replacement killed: a new event
            DIED.format(t="12:00:35", pid=300),  # 4 s after the last printed one: folded
            DIED.format(t="12:00:41", pid=300),  # a process named before: folded
            DIED.format(t="12:00:42", pid=400),  # 11 s after: printed
        ]
    )
    assert out == [
        DIED.format(t="12:00:00", pid=100),
        DIED.format(t="12:00:31", pid=200),
        DIED.format(t="12:00:42", pid=400),
    ]


def test_a_message_without_a_pid_still_prints_at_powers_of_ten() -> None:
    line = "12:00:{s:02d} WARNING [orchestrator] inference server 0 is down ({n} requests)"
    out = _printed([line.format(s=i, n=i) for i in range(12)])
    assert out == [line.format(s=0, n=0), line.format(s=0, n=0) + " (x10)"]


def _local(hms: str, day: float) -> float:
    """The epoch time of HH:MM:SS on the local day of `day`."""
    h, m, s = map(int, hms.split(":"))
    return time.mktime(time.localtime(day)[:3] + (h, m, s, 0, 0, -1))


def _run(tmp_path: Path) -> RunPaths:
    paths = RunPaths(tmp_path)
    paths.logs_dir.mkdir(parents=True)
    return paths


def test_status_keeps_the_newest_distinct_warnings_in_the_window(tmp_path: Path) -> None:
    paths = _run(tmp_path)
    day = time.time()
    paths.log_file("orchestrator").write_text(
        "\n".join(
            [
                "11:00:00 WARNING [orchestrator] trainer_0: no progress for 7 s",  # an hour old
                DIED.format(t="11:58:00", pid=100),
                "11:58:30 INFO    [orchestrator] step 40",
                DIED.format(t="11:59:00", pid=200),
                "11:59:10 WARNING [orchestrator] rollout 7 errored: ValueError",  # counted in causes
                "11:59:20 ERROR   [orchestrator] env server for train env 'x' died (exit code -9)",
                "  Traceback line that is not printed",
            ]
        )
        + "\n"
    )
    (paths.logs_dir / "trainer").mkdir()
    paths.rank_log_file("trainer", 1).write_text("11:59:05 WARNING [trainer] rank 1: slow step 41\n")
    now = _local("12:00:00", day)
    for f in (paths.log_file("orchestrator"), paths.rank_log_file("trainer", 1)):
        os.utime(f, (now, now))
    shown = recent_warnings(paths, 600, now=now)
    assert shown == [
        DIED.format(t="11:59:00", pid=200) + " (x2 since 11:58:00)",
        "11:59:05 WARNING [trainer] rank 1: slow step 41",
        "11:59:20 ERROR [orchestrator] env server for train env 'x' died (exit code -9)",
    ]
    assert recent_warnings(paths, 600, limit=1, now=now) == [shown[-1]]
    # a run that ended: its newest ones, however old
    assert recent_warnings(paths, None, now=now + 86400 * 3)[0] == (
        "11:00:00 WARNING [orchestrator] trainer_0: no progress for 7 s"
    )
    # a log not written within the window is not read
    old = now - 3600
    os.utime(paths.log_file("orchestrator"), (old, old))
    assert recent_warnings(paths, 600, now=now) == ["11:59:05 WARNING [trainer] rank 1: slow step 41"]


def test_the_window_spans_midnight(tmp_path: Path) -> None:
    paths = _run(tmp_path)
    day = time.time()
    paths.log_file("trainer").write_text(
        "23:40:00 WARNING [trainer] too old\n23:59:30 WARNING [trainer] before midnight\n"
        "00:00:10 WARNING [trainer] after midnight\n"
    )
    now = _local("00:01:00", day)
    os.utime(paths.log_file("trainer"), (now, now))
    assert recent_warnings(paths, 600, now=now) == [
        "23:59:30 WARNING [trainer] before midnight",
        "00:00:10 WARNING [trainer] after midnight",
    ]


def test_only_the_tail_of_a_huge_log_is_read(tmp_path: Path) -> None:
    paths = _run(tmp_path)
    filler = "".join(f"12:00:00 WARNING [trainer] old message {i} x\n" for i in range(5000))
    paths.log_file("trainer").write_text(filler + "12:00:01 WARNING [trainer] newest\n")
    shown = recent_warnings(paths, None, limit=100, tail_bytes=200)
    assert shown[-1] == "12:00:01 WARNING [trainer] newest"
    assert 1 <= len(shown) <= 5  # the tail's whole lines only (numbers fold the rest into one)


def test_hpcrl_status_prints_them(tmp_path: Path) -> None:
    paths = _run(tmp_path)
    paths.configs_dir.mkdir()
    paths.log_file("orchestrator").write_text(DIED.format(t="01:02:03", pid=4242) + "\n")
    out = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "status", str(tmp_path)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    i = lines.index(f"recent warnings (newest; all: hpcrl logs {tmp_path} --warnings):")
    assert lines[i + 1] == "  " + DIED.format(t="01:02:03", pid=4242)


def test_a_stall_printed_for_a_new_process_gets_its_recovery_printed() -> None:
    stall = "12:0{m}:00 WARNING [orchestrator] orchestrator: no progress for 7 s; no stacks of inference_0 (pid {p})"
    back = "12:0{m}:09 WARNING [orchestrator] orchestrator: moving again (inference answered) after 9 s"
    out = _printed([stall.format(m=0, p=1), back.format(m=0), stall.format(m=1, p=2), back.format(m=1)])
    assert out == [stall.format(m=0, p=1), back.format(m=0), stall.format(m=1, p=2), back.format(m=1)]
