"""A log or a bus file the filesystem refuses is never worth a role (issue 52): a child whose log
cannot be opened starts all the same, its output dropped and the refusal named once; a bus cleanup
whose deletion is refused leaves the file for the next cleanup. Real refusals: `chattr +i` as root
(no entry can be made or removed, root included), chmod 0555 otherwise."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.bus.files import remove_bus_part
from hpcrl.storage import dropped_log_lines, open_log


def _unwritable(d: Path):
    if os.geteuid() == 0:
        if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode != 0:
            pytest.skip("chattr +i refused here (filesystem without the immutable flag)")
        return ["chattr", "-i", str(d)]
    d.chmod(0o555)
    return ["chmod", "0755", str(d)]


def _until(cond, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_child_whose_log_cannot_be_opened_starts_and_its_output_follows_once_it_can(
    tmp_path, caplog, monkeypatch
) -> None:
    """The child starts on a pipe: what it prints while its log cannot be made is dropped and
    counted; once the directory takes writes again, the rest reaches the log, after a line saying how
    many were lost (before: /dev/null until the child's next start)."""
    from hpcrl import storage

    monkeypatch.setattr(storage, "RELAY_RETRY_S", 0.1)
    logs = tmp_path / "logs"
    logs.mkdir()
    undo = _unwritable(logs)
    before = dropped_log_lines()[0]
    child = "print('one', flush=True); input(); print('two', flush=True); raise SystemExit(7)"
    try:
        with (
            caplog.at_level(logging.WARNING, logger="hpcrl.storage"),
            open_log(logs / "worker_0.log", "env worker 0") as out,
        ):
            proc = subprocess.Popen([sys.executable, "-c", child], stdout=out, stdin=subprocess.PIPE)
        _until(lambda: dropped_log_lines()[0] == before + 1)  # 'one': dropped, counted
        assert not (logs / "worker_0.log").exists()
    except BaseException:
        subprocess.run(undo, check=True)
        raise
    subprocess.run(undo, check=True)
    time.sleep(0.2)  # past RELAY_RETRY_S: the next output tries the log again
    proc.communicate(b"go\n", timeout=30)
    assert proc.returncode == 7  # it ran all along
    _until(lambda: (logs / "worker_0.log").exists() and "two" in (logs / "worker_0.log").read_text())
    note, rest = (logs / "worker_0.log").read_text().split("\n", 1)
    assert note.endswith(
        f"WARNING [env worker 0] 1 log line(s) lost: not writable (operation not permitted) at {logs}/worker_0.log (Operation not permitted)"
    ) or ("permission denied" in note), note
    assert rest == "two\n"
    said = [r.getMessage() for r in caplog.records if r.name == "hpcrl.storage"]
    assert (
        said[0].startswith(
            f"env worker 0: cannot open its log: not writable (operation not permitted) at {logs}/worker_0.log"
        )
        or "permission denied" in said[0]
    ), said
    assert said[1].startswith("env worker 0: its log can be written again after "), said
    assert "1 line(s) of its output lost" in said[1], said


def test_a_log_that_can_be_opened_is_appended_to(tmp_path) -> None:
    path = tmp_path / "a" / "b.log"
    with open_log(path, "x") as out:
        out.write(b"one\n")
    with open_log(path, "x") as out:
        out.write(b"two\n")
    assert path.read_text() == "one\ntwo\n"


def test_a_refused_bus_cleanup_leaves_the_file_for_the_next_one(tmp_path) -> None:
    step = tmp_path / "rollouts" / "step_4"
    step.mkdir(parents=True)
    (step / "rank_0.msgpack").write_bytes(b"batch")
    (step / "train").mkdir()  # saved rollouts (hpcrl.bus.files.SAVED_SPLITS): they stay, the bus files go
    undo = _unwritable(step)
    try:
        remove_bus_part(step)  # raised PermissionError / OSError(EROFS) before: the trainer died of it
        assert (step / "rank_0.msgpack").exists()
    finally:
        subprocess.run(undo, check=True)
    remove_bus_part(step)  # the next cleanup, once it is writable again
    assert not (step / "rank_0.msgpack").exists() and (step / "train").is_dir()
