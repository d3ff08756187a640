"""The roles' WARNING/ERROR lines on the console (hpcrl.launch.alerts): each distinct message once
(numbers masked), again at 10, 100, ... with its count; new lines only, whole lines only."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hpcrl.launch.alerts import Alerts, ConsoleAlerts, distinct, key_of, role_logs
from hpcrl.launch.console import ConsoleReporter
from hpcrl.launch.dashboard_hint import dashboard_lines
from hpcrl.launch.logview import records
from hpcrl.paths import RunPaths

STALL = "12:00:0{s} WARNING [orchestrator] orchestrator: no progress for {n} s (last: published batch {b})"


def _recs(*lines: str):
    return list(records(list(lines)))


def test_each_distinct_message_once_then_at_powers_of_ten() -> None:
    a = Alerts()
    lines = [STALL.format(s=i % 10, n=6 + i, b=i) for i in range(100)]
    printed = [out for r in _recs(*lines) if (out := a.see(r)) is not None]
    assert printed == [
        "12:00:00 WARNING [orchestrator] orchestrator: no progress for 6 s (last: published batch 0)",
        "12:00:00 WARNING [orchestrator] orchestrator: no progress for 6 s (last: published batch 0) (x10)",
        "12:00:00 WARNING [orchestrator] orchestrator: no progress for 6 s (last: published batch 0) (x100)",
    ]
    assert key_of("pid 4242 after 6.5 s") == key_of("pid 17 after 12 s")


def test_info_lines_and_tracebacks_are_not_printed() -> None:
    a = Alerts()
    recs = _recs(
        "12:00:00 INFO    [trainer] step 3 done",
        "12:00:01 ERROR   [trainer] trainer failed: disk full at /x (No space left on device)",
        "Traceback (most recent call last):",
        '  File "x.py", line 1',
        "12:00:02 WARNING [inference] inference: this process did not run for 9 s",
        "12:00:03 WARNING [orchestrator] rollout 3 errored: ValueError: no answer",
        "12:00:03 WARNING [orchestrator] env calc: rollout errored: ValueError: no answer (first occurrence; "
        "1 so far, 0 succeeded)",
    )
    out = [line for r in recs if (line := a.see(r)) is not None]
    assert out == [
        "12:00:01 ERROR [trainer] trainer failed: disk full at /x (No space left on device)",
        "12:00:02 WARNING [inference] inference: this process did not run for 9 s",
        "12:00:03 WARNING [orchestrator] env calc: rollout errored: ValueError: no answer (first occurrence; "
        "1 so far, 0 succeeded)",
    ]


def test_same_text_of_two_roles_is_two_messages_and_summary_counts() -> None:
    lines = [
        "12:00:00 WARNING [orchestrator] server 0 is down",
        "12:00:01 WARNING [trainer] server 0 is down",
        "12:00:05 WARNING [orchestrator] server 1 is down",
    ]
    assert distinct(_recs(*lines)) == [
        "12:00:00 WARNING [orchestrator] server 0 is down (x2, last 12:00:05)",
        "12:00:01 WARNING [trainer] server 0 is down",
    ]


def test_console_prints_new_whole_lines_of_every_role_log(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    old = paths.log_file("orchestrator")
    old.parent.mkdir(parents=True)
    old.write_text("11:00:00 WARNING [orchestrator] from the run before the resume\n")
    c = ConsoleAlerts(paths)
    assert c.poll() == []  # what was there before is not news
    with open(old, "a") as f:
        f.write("12:00:00 WARNING [orchestrator] inference server 0 does not answer /health\n12:00:01 WARN")
    rank = paths.rank_log_file("inference", 1)  # appears later
    rank.parent.mkdir(parents=True)
    rank.write_text("12:00:00 ERROR   [inference] inference server 1 failed: CUDA out of memory\n")
    assert c.poll() == [
        "12:00:00 WARNING [orchestrator] inference server 0 does not answer /health",
        "12:00:00 ERROR [inference] inference server 1 failed: CUDA out of memory",
    ]
    with open(old, "a") as f:  # the half-written line, finished
        f.write("ING [orchestrator] inference server 0 answers /health again after 9 s\n")
    assert c.poll() == ["12:00:01 WARNING [orchestrator] inference server 0 answers /health again after 9 s"]
    assert rank in role_logs(paths)


def test_console_reporter_prints_them_between_step_lines(tmp_path: Path, capsys) -> None:
    paths = RunPaths(tmp_path)
    console = ConsoleReporter(paths, max_steps=3, bar=False)
    log = paths.log_file("trainer")
    log.parent.mkdir(parents=True)
    log.write_text("12:00:00 WARNING [trainer] trainer_0: no progress for 60 s\n")
    console.update()
    assert capsys.readouterr().out == "12:00:00 WARNING [trainer] trainer_0: no progress for 60 s\n"


def test_logs_warnings_command(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path)
    paths.logs_dir.mkdir(parents=True)
    paths.configs_dir.mkdir()
    paths.log_file("orchestrator").write_text(
        "".join(STALL.format(s=i, n=6 + i, b=i) + "\n" for i in range(3))
        + "12:00:09 INFO    [orchestrator] step 9\n"
    )
    (paths.logs_dir / "trainer").mkdir()
    paths.rank_log_file("trainer", 1).write_text("12:00:03 ERROR   [trainer] rank 1 failed\n")
    out = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "logs", str(tmp_path), "--warnings"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        STALL.format(s=0, n=6, b=0) + " (x3, last 12:00:02)",
        "12:00:03 ERROR [trainer] rank 1 failed",
    ]


def test_dashboard_line() -> None:
    first, tunnel = dashboard_lines("/runs/my run", host="login1.cluster")
    assert first == "hpcrl dashboard '/runs/my run'  ->  http://127.0.0.1:8765/"
    assert tunnel.startswith("from your laptop: ssh -N -L 8765:127.0.0.1:8765 login1.cluster")


def test_tmux_sh_prints_the_dashboard_line(tmp_path: Path) -> None:
    import os
    import shutil
    import uuid

    import pytest

    if shutil.which("tmux") is None:
        pytest.skip("tmux not installed")
    sock = f"hpcrl-test-{uuid.uuid4().hex[:8]}"
    env = {k: v for k, v in os.environ.items() if k != "TMUX"}
    env.update(TMUX_NO_ATTACH="1", HPCRL_TMUX_SOCKET=sock)
    script = Path(__file__).resolve().parents[2] / "tmux.sh"
    try:
        out = subprocess.run(
            ["bash", str(script), "dash", str(tmp_path)], env=env, capture_output=True, text=True
        )
    finally:
        subprocess.run(["tmux", "-L", sock, "kill-server"], capture_output=True)
    assert out.returncode == 0, out.stderr
    assert f"dashboard: hpcrl dashboard {tmp_path}  ->  http://127.0.0.1:8765/" in out.stdout
    assert "ssh -N -L 8765:127.0.0.1:8765 " in out.stdout


def test_a_recovery_is_printed_after_every_printed_stall() -> None:
    """The CI failure of stop 54: a slow start-up stall and its "moving again", then a frozen server
    named (a new text, printed) whose "moving again" was swallowed as a repeat of the first."""
    a = Alerts()
    recs = _recs(
        "12:00:00 WARNING [orchestrator] orchestrator: no progress for 6 s (last: started); waiting on trainer",
        "12:00:01 WARNING [orchestrator] orchestrator: moving again (step 1) after 7 s without progress",
        "12:00:05 WARNING [orchestrator] orchestrator: no progress for 5 s (last: step 3); inference server 0",
        "12:00:09 WARNING [orchestrator] orchestrator: moving again (step 4) after 9 s without progress",
        "12:00:10 WARNING [orchestrator] orchestrator: no progress for 5 s (last: step 4); inference server 0",
        "12:00:12 WARNING [orchestrator] orchestrator: moving again (step 5) after 7 s without progress",
    )
    out = [line for r in recs if (line := a.see(r)) is not None]
    assert out == [
        "12:00:00 WARNING [orchestrator] orchestrator: no progress for 6 s (last: started); waiting on trainer",
        "12:00:01 WARNING [orchestrator] orchestrator: moving again (step 1) after 7 s without progress",
        "12:00:05 WARNING [orchestrator] orchestrator: no progress for 5 s (last: step 3); inference server 0",
        "12:00:09 WARNING [orchestrator] orchestrator: moving again (step 4) after 9 s without progress",
    ]  # the third stall repeats the second's text: neither it nor its recovery is printed again


def test_a_write_refused_again_after_it_cleared_is_printed_again() -> None:
    """A full disk twice in a run (hpcrl.storage): the second refusal's line differs from the first
    only in its numbers, yet it is printed, as is the write going through after it; a refusal still
    open (every rank saying it, the same write refused again) is counted as before."""
    refused = (
        "12:00:0{s} WARNING [trainer] trainer: cannot write checkpoint step {n}: disk full at "
        "/r/checkpoints/step_{n} (No space left on device), ENOSPC; free space there: 0 B free of "
        "268.4 MB; retrying in 1 s, doubling to 30 s, for up to 30 s (storage_timeout_s)"
    )
    wrote = "12:00:0{s} WARNING [trainer] trainer: wrote checkpoint step {n} after 9 s (it was: disk full)"
    a = Alerts()
    lines = [
        refused.format(s=0, n=140),
        refused.format(s=1, n=140),  # another rank, the same episode: counted, not printed
        wrote.format(s=2, n=140),
        refused.format(s=3, n=160),
        wrote.format(s=4, n=160),
    ]
    printed = [out for r in _recs(*lines) if (out := a.see(r)) is not None]
    assert printed == [
        lines[0],
        lines[2],
        lines[3],  # the same text, numbers aside: printed again, with its own figures
        lines[4],
    ]
