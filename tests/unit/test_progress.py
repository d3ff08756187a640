"""hpcrl.monitor.progress: a stall is named once within its bound, with whom the role waits on, the
peer's own report quoted, stacks written; progress afterwards is said once; the bound follows the
step time; the hot-path report is cheap."""

from __future__ import annotations

import json
import logging
import re
import time

import pytest

from hpcrl.monitor.progress import Progress, read_progress, report_of


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_stall_named_once_with_peer_and_stacks(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    prog, stalls = tmp_path / "progress", tmp_path / "stalls"
    peer = Progress("trainer_0", prog, stalls, bound_s=0)  # reports, never names
    peer.moved("trained step 15")
    _wait(lambda: (prog / "trainer_0.json").exists())
    peer.stop()  # a frozen trainer: its file stops being refreshed
    p = Progress("orchestrator", prog, stalls, bound_s=1.0, poll_s=0.1)
    with caplog.at_level(logging.WARNING, "hpcrl.progress"):
        p.waiting("policy 16 from the trainer (policy/step_16.msgpack)", "trainer")
        t0 = time.monotonic()
        _wait(lambda: any("no progress" in r.getMessage() for r in caplog.records))
        named = time.monotonic() - t0
        # the request to the other roles is written once the stall's own stacks are (a starved
        # watcher thread can be slow to get there)
        _wait(lambda: stalls.is_dir() and any(stalls.glob("request-orchestrator-*")))
        time.sleep(0.3)  # a second naming would come within 0.1 s
        stalls_lines = [r.getMessage() for r in caplog.records if "no progress" in r.getMessage()]
        assert len(stalls_lines) == 1 and named < 3.0
        line = stalls_lines[0]
        # 1 s past the bound of 1 s, or 2 s where the watcher thread (0.1 s polls) was starved
        assert re.search(r"orchestrator: no progress for [12] s", line), line
        assert re.search(
            r"waiting on policy 16 from the trainer \(policy/step_16\.msgpack\) for [12] s", line
        )
        assert "trainer_0 running, last reported" in line and "trained step 15" in line
        dumps = sorted(x.name for x in stalls.iterdir())
        assert any(d.startswith("orchestrator-") and "-stall-" in d for d in dumps)
        assert (
            "in test_stall_named_once_with_peer_and_stacks"
            in next(stalls.glob("orchestrator-*-stall-*.txt")).read_text()
        )
        _wait(lambda: json.loads((prog / "orchestrator.json").read_text())["state"] == "stalled")
        p.done()
        p.moved("loaded policy 16")
        _wait(lambda: any("moving again" in r.getMessage() for r in caplog.records))
    rows = {r["role"]: r for r in read_progress(prog)}
    assert rows["orchestrator"]["stall"] is not None or rows["orchestrator"]["state"] == "running"
    time.sleep(6.0)
    assert "trainer_0 unresponsive" in report_of(prog, "trainer")
    p.stop()


def test_bound_follows_step_time() -> None:
    p = Progress("x", None, None, bound_s=1.0, poll_s=5)
    for _ in range(4):
        p._step_at = time.monotonic() - 2.0
        p.step(1)
    assert 5.9 < p.bound() < 6.5  # 3x the 2 s steps
    p.stop()


def test_report_cost_is_tiny() -> None:
    p = Progress("x", None, None, bound_s=0, poll_s=5)
    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):
        p.moved("inference answered")
    per_call = (time.perf_counter() - t0) / n
    assert per_call < 5e-6, per_call
    p.stop()


def test_a_refused_write_is_in_the_progress_file_at_once(tmp_path) -> None:
    """hpcrl.storage's refusal reaches `hpcrl status` without waiting for the next refresh (every
    2 s): a role whose storage_timeout_s is short would end before then."""
    import errno

    from hpcrl import storage
    from hpcrl.monitor import progress

    p = progress.start("trainer_0", tmp_path, None, bound_s=60)  # refreshed every 2 s
    try:
        _wait(lambda: (tmp_path / "trainer_0.json").exists())
        p._poll = 60  # from here on only a nudge writes the file: the watcher waits 60 s between
        p.nudge()  # refreshes once this wakes it from its current 2 s wait
        time.sleep(0.3)
        r = storage.Refusals("trainer", "checkpoint step 2", 30, path=tmp_path / "ck")
        r.refused(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ck")))

        def waiting() -> str | None:
            return json.loads((tmp_path / "trainer_0.json").read_text()).get("waiting_on")

        _wait(lambda: waiting() is not None)  # long before the 60 s refresh: the nudge wrote it
        assert waiting().startswith("writing checkpoint step 2: disk full at "), waiting()
        r.cleared()
        _wait(lambda: waiting() is None)
    finally:
        p.stop()
        storage.report_to(lambda what, on: None, lambda what: None)


def test_a_write_retried_behind_another_wait_stays_in_status(tmp_path) -> None:
    """A checkpoint's finaliser (a background thread) retries a refused write while the main loop
    waits on something else: both stay in the progress file, the stall line and `hpcrl status`, and
    the write going through clears only itself."""
    import errno
    import threading

    from hpcrl import storage
    from hpcrl.launch.stallview import health_lines
    from hpcrl.monitor import progress
    from hpcrl.paths import RunPaths

    paths = RunPaths(tmp_path)
    p = progress.start("trainer_0", paths.progress_dir, None, bound_s=60)
    r = storage.Refusals("trainer", "checkpoint step 4", 30, path=tmp_path / "ck")
    try:
        t = threading.Thread(
            target=r.refused, args=(OSError(errno.EROFS, "Read-only file system", str(tmp_path / "ck")),)
        )
        t.start()
        t.join()
        progress.waiting("batch 5 from the orchestrator")  # the main loop's next wait
        p.write(time.monotonic(), 0.0)
        shown = "\n".join(health_lines(paths, running=True))
        assert "waiting on batch 5 from the orchestrator for 0 s" in shown, shown
        assert "waiting on writing checkpoint step 4: read-only filesystem at " in shown, shown
        assert "writing checkpoint step 4" in (p.describe_wait(time.monotonic()) or "")
        r.cleared()
        p.write(time.monotonic(), 0.0)
        shown = "\n".join(health_lines(paths, running=True))
        assert "waiting on batch 5" in shown and "checkpoint step 4" not in shown, shown
    finally:
        p.stop()
        storage.report_to(lambda what, on: None, lambda what: None)


def test_a_progress_file_built_earlier_never_lands_after_a_newer_one(tmp_path) -> None:
    """The watcher thread (nudged by a refused write) and the main loop both write the progress file:
    the one that read the role's state last writes last, so a stale wait never overwrites a newer
    one (the race CI hit in the test above)."""
    import threading

    p = Progress("trainer_0", tmp_path, None, bound_s=60, poll_s=60)
    entered, first = threading.Event(), [True]

    def slow_extra() -> dict:  # the watcher's doc, built before the main loop's wait, lands slowly
        if threading.current_thread().name == "hpcrl-progress" and first[0]:
            first[0] = False
            entered.set()
            time.sleep(0.5)
        return {}

    try:
        p.extra = slow_extra
        p.waiting("writing checkpoint step 4: read-only filesystem")
        p.nudge()
        assert entered.wait(10)
        p.waiting("batch 5 from the orchestrator")
        p.write(time.monotonic(), 0.0)
        time.sleep(0.7)  # the watcher's slow write has finished by now
        doc = json.loads((tmp_path / "trainer_0.json").read_text())
        assert doc["waiting_on"] == "batch 5 from the orchestrator", doc
    finally:
        p.stop()
