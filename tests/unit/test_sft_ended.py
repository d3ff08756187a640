"""`hpcrl status` of an `hpcrl sft` run that ended: its `ended:` line is the run's last line, recorded
in the job file by the process that ran the rank (hpcrl.launch.sft.recorded) whatever ended it: a
clean finish, a rank's last ERROR line (a write refused past storage_timeout_s), an exception,
Ctrl-C, the watchdog's os._exit (hpcrl.monitor.watchdog.on_exit). A job file that cannot be written
never masks the run's own end."""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpcrl.errors import UserError
from hpcrl.launch import manage
from hpcrl.launch.local import FINISHED
from hpcrl.launch.manage import read_job, status, write_job
from hpcrl.launch.sft import INTERRUPTED, LastError, last_line, recorded
from hpcrl.monitor import watchdog
from hpcrl.paths import RunPaths

REPO = str(Path(__file__).resolve().parents[2])
REFUSED = "cannot write checkpoint step 2 for 2 s: disk full at /x/checkpoints (No space left on device)"


@pytest.fixture
def paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunPaths:
    monkeypatch.setattr(watchdog, "_last_words", [])  # recorded() adds its hook: not for other tests
    p = RunPaths(tmp_path / "run")
    (p.root / "configs").mkdir(parents=True)
    write_job(p, {"target": "local", "pid": 2**22 + 12345, "started_at": 0})  # no such pid
    return p


def _ended(paths: RunPaths) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status([str(paths.root)])
    return next(x for x in out.getvalue().splitlines() if x.startswith("ended:")).split(None, 1)[1]


def test_the_last_line_is_the_error_or_says_it_finished() -> None:
    assert last_line(0, "an earlier error") == FINISHED == "hpcrl: run finished"  # `hpcrl run`'s
    assert last_line(1, "sft trainer failed: x") == "sft trainer failed: x"
    assert last_line(3, "") == "hpcrl sft: exited with code 3"
    stop = "stop requested: checkpointed step 6, exiting"  # hpcrl.trainer.sft's line on SIGTERM
    assert last_line(0, "", stop) == f"hpcrl sft: {stop}"  # stopped early: not "finished"
    h = LastError()
    log = logging.getLogger("hpcrl.test_sft_ended")
    log.addHandler(h)
    try:
        log.warning("not an error")
        log.error("sft trainer failed: %s\nmore", REFUSED)
        log.warning("stop requested: %s, exiting", "checkpointed step 6")
    finally:
        log.removeHandler(h)
    assert h.stopped == stop
    assert h.line == f"sft trainer failed: {REFUSED}"


def test_a_clean_finish_is_recorded(paths: RunPaths) -> None:
    assert recorded(paths, lambda: 0) == 0
    assert _ended(paths) == "hpcrl: run finished (exit 0)"
    assert read_job(paths)["target"] == "local"  # kept


def test_a_refused_write_past_the_bound_is_recorded_as_the_rank_said_it(paths: RunPaths) -> None:
    def run() -> int:
        logging.getLogger("hpcrl.trainer").error("sft trainer failed: %s", REFUSED)
        return 1

    assert recorded(paths, run) == 1
    assert _ended(paths) == f"sft trainer failed: {REFUSED} (exit 1)"


@pytest.mark.parametrize(
    ("exc", "line"),
    [
        (KeyboardInterrupt(), f"{INTERRUPTED} (exit 130)"),
        (RuntimeError("boom\nat line 2"), "sft trainer failed: RuntimeError: boom\\nat line 2 (exit 1)"),
        (UserError("no such data file"), "hpcrl: error: no such data file (exit 2)"),
    ],
)
def test_what_it_raised_is_recorded_and_raised(paths: RunPaths, exc: BaseException, line: str) -> None:
    def run() -> int:
        raise exc

    with pytest.raises(type(exc)):
        recorded(paths, run)
    assert _ended(paths) == line


def test_a_job_file_that_cannot_be_written_masks_nothing(
    paths: RunPaths, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*_: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(paths.job_file))

    monkeypatch.setattr(manage, "write_job", full)

    def run() -> int:
        raise RuntimeError("the real error")

    with pytest.raises(RuntimeError, match="the real error"):
        recorded(paths, run)
    assert recorded(paths, lambda: 0) == 0
    assert "ended" not in read_job(paths)


def test_the_watchdog_says_its_last_line_to_the_hooks_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(watchdog, "_last_words", [])
    heard: list[tuple[int, str]] = []
    hung = threading.Event()
    watchdog.on_exit(lambda code, line: heard.append((code, line)))
    watchdog.on_exit(lambda *_: hung.wait(30))  # a hook on a hung filesystem
    t0 = time.monotonic()
    watchdog.say_last(3, "watchdog: sft made no progress", timeout_s=0.5)
    assert time.monotonic() - t0 < 5
    hung.set()
    assert heard == [(3, "watchdog: sft made no progress")]


STALL = """
import sys, time
from pathlib import Path
from hpcrl.launch.sft import recorded
from hpcrl.monitor.watchdog import Watchdog
from hpcrl.paths import RunPaths

def run():
    Watchdog("sft", timeout_s=0.5, poll_s=0.05).beat("trained step 3")
    time.sleep(30)  # a hung collective
recorded(RunPaths(Path(sys.argv[1])), run)
"""


def test_the_watchdog_ending_the_rank_is_recorded(paths: RunPaths) -> None:
    p = subprocess.run(
        [sys.executable, "-c", STALL, str(paths.root)], capture_output=True, text=True, timeout=30, cwd=REPO
    )
    assert p.returncode == watchdog.EXIT_STALLED, p.stderr[-2000:]
    line = _ended(paths)
    assert line.startswith("watchdog: sft made no progress for "), line
    assert line.endswith("s (last: trained step 3); ending the job (exit 3)"), line
