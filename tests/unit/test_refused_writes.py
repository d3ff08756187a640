"""The storage policy (hpcrl.storage, issue 52): a write the filesystem refuses (disk full, quota,
read-only, I/O error) is named once with its path, errno and the free space there, retried with
backoff (1 s doubling to 30 s), and ends the role in one line naming the path and storage_timeout_s
past that bound. Real refusals where the box allows them: `chattr +i` (as root chmod stops nothing)
and a full tmpfs."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import subprocess
import threading
import time
from itertools import islice
from pathlib import Path

import pytest

from hpcrl import fileio, storage
from hpcrl.orchestrator.writes import write_retrying
from hpcrl.storage import WriteRefused, backoff, free_space, retry_blocking
from tests.integration.faults import Filler, _make_unwritable, _mount_tmpfs


def test_a_write_that_fails_mid_file_names_the_file_and_leaves_no_tmp(tmp_path: Path, monkeypatch) -> None:
    def full(fd: int, data) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")  # what write(2) raises: no file name

    monkeypatch.setattr(fileio.os, "write", full)
    with pytest.raises(OSError) as got:
        fileio.write_atomic(tmp_path / "a.bin", [b"x"])
    assert got.value.errno == errno.ENOSPC and got.value.filename == str(tmp_path / "a.bin")
    assert fileio.refused_write(got.value) == (f"disk full at {tmp_path / 'a.bin'} (No space left on device)")
    assert list(tmp_path.iterdir()) == []


def test_refused_write_reads_oserrors_and_wrapped_rust_io_errors() -> None:
    assert fileio.refused_write(PermissionError(errno.EACCES, "x", "/r/rollouts")) == (
        "not writable (permission denied) at /r/rollouts (Permission denied)"
    )
    rust = RuntimeError(
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No ..." })'
    )
    assert fileio.refused_write(rust, "/c/step_5") == "disk full at /c/step_5 (No space left on device)"
    safetensors = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert fileio.refused_write(safetensors, "/c/s") == "disk full at /c/s (No space left on device)"
    err = fileio.refused_error(rust, "/c/step_5")
    assert isinstance(err, OSError) and err.errno == errno.ENOSPC and err.filename == "/c/step_5"
    # the four the issue names, as OSErrors and as Rust prints them
    assert fileio.refused_error(OSError(errno.EIO, "Input/output error", "/c/x")).errno == errno.EIO
    assert fileio.refused_error(RuntimeError("I/O error: Input/output error (os error 5)")).errno == errno.EIO
    assert (
        fileio.refused_error(RuntimeError("Os { code: 30, kind: ReadOnlyFilesystem }")).errno == errno.EROFS
    )
    assert fileio.refused_error(RuntimeError("IoError(Custom { kind: ReadOnlyFilesystem })")).errno == (
        errno.EROFS
    )
    assert fileio.refused_error(OSError(errno.EDQUOT, "Disk quota exceeded")).errno == errno.EDQUOT
    assert (
        fileio.refused_write(FileNotFoundError(errno.ENOENT, "gone", "/x")) is None
    )  # a bug, not a full disk
    assert fileio.refused_write(ValueError("bad")) is None


def test_backoff_doubles_from_1_s_to_30_s() -> None:
    assert list(islice(backoff(), 8)) == [1, 2, 4, 8, 16, 30, 30, 30]
    assert list(islice(backoff(0.5, 3), 5)) == [0.5, 1, 2, 3, 3]


class _Statvfs:
    f_frsize, f_bavail, f_blocks = 4096, 3000, 15625  # 12,288,000 B free of 64,000,000 B


def test_free_space_says_what_statvfs_says_or_unknown(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(storage.os, "statvfs", lambda p: _Statvfs)
    assert free_space(tmp_path / "no" / "such" / "dir") == "12.3 MB free of 64.0 MB"

    def fails(p):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(storage.os, "statvfs", fails)
    assert free_space(tmp_path) == "unknown" and free_space(None) == "unknown"


def test_the_policy_backs_off_names_once_and_gives_up_at_the_bound_in_one_line(monkeypatch, caplog) -> None:
    """Hand-checked on a fake clock: tries at t = 0, 1, 3, 7, 15, 31 and 60 s; the waits 1, 2, 4, 8,
    16 and then 29 (30 would pass the 60 s bound); at t = 60 the one line."""
    monkeypatch.setattr(storage.os, "statvfs", lambda p: _Statvfs)
    now, tries, sleeps = [0.0], [], []

    def sleep(s: float) -> None:
        sleeps.append(s)
        now[0] += s

    def write() -> None:
        tries.append(now[0])
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), "/r/broadcasts/step_14")

    with caplog.at_level(logging.WARNING, "hpcrl.storage"), pytest.raises(WriteRefused) as got:
        retry_blocking("trainer", "policy 14", write, 60, sleep=sleep, clock=lambda: now[0])
    assert tries == [0, 1, 3, 7, 15, 31, 60] and sleeps == [1, 2, 4, 8, 16, 29]
    lines = [r.getMessage() for r in caplog.records if r.name == "hpcrl.storage"]
    assert lines == [
        "trainer: cannot write policy 14: read-only filesystem at /r/broadcasts/step_14 (Read-only file "
        "system), EROFS; free space there: 12.3 MB free of 64.0 MB; retrying in 1 s, doubling to 30 s, "
        "for up to 60 s (storage_timeout_s)"
    ]  # named once for seven refusals
    assert str(got.value) == (
        "cannot write policy 14 for 60 s: read-only filesystem at /r/broadcasts/step_14 (Read-only file "
        "system), EROFS; free space there: 12.3 MB free of 64.0 MB (storage_timeout_s = 60)"
    )
    assert "\n" not in str(got.value) and got.value.errno == errno.EROFS
    assert fileio.refused_write(got.value) == str(got.value)  # the role's last line is this one


def test_a_new_cause_is_named_again_and_other_errors_pass_at_once(caplog) -> None:
    errs = [
        OSError(errno.ENOSPC, "No space left on device", "/r/a"),
        OSError(errno.ENOSPC, "No space left on device", "/r/a"),
        OSError(errno.EIO, "Input/output error", "/r/a"),
    ]

    def write() -> str:
        if errs:
            raise errs.pop(0)
        return "ok"

    with caplog.at_level(logging.WARNING, "hpcrl.storage"):
        assert retry_blocking("orchestrator", "x", write, 60, sleep=lambda s: None) == "ok"
    lines = [r.getMessage() for r in caplog.records if r.name == "hpcrl.storage"]
    assert [("ENOSPC" in m, "EIO;" in m) for m in lines[:2]] == [(True, False), (False, True)]
    assert lines[2].startswith("orchestrator: wrote x after") and len(lines) == 3

    def bug() -> None:
        raise FileNotFoundError(errno.ENOENT, "No such file", "/nowhere")

    with pytest.raises(FileNotFoundError):
        retry_blocking("orchestrator", "x", bug, 60, sleep=lambda s: None)
    with pytest.raises(FileNotFoundError):
        asyncio.run(write_retrying("x", bug, 60))


def test_the_async_face_is_the_same_policy(caplog) -> None:
    tries = []

    def write() -> str:
        tries.append(time.monotonic())
        if len(tries) < 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/r/rollouts/step_3/rank_0.msgpack")
        return "done"

    with caplog.at_level(logging.WARNING, "hpcrl.storage"):
        got = asyncio.run(write_retrying("rollouts step 3", write, 30, first_s=0.01, cap_s=0.02))
    assert got == "done" and len(tries) == 4
    lines = [r.getMessage() for r in caplog.records if r.name == "hpcrl.storage"]
    assert lines[0].startswith(
        "orchestrator: cannot write rollouts step 3: disk full at /r/rollouts/step_3/rank_0.msgpack"
    )
    assert "ENOSPC" in lines[0] and "retrying in 0.01 s, doubling to 0.02 s, for up to 30 s" in lines[0]
    assert lines[1].startswith("orchestrator: wrote rollouts step 3 after") and len(lines) == 2
    with pytest.raises(WriteRefused) as gone:
        asyncio.run(write_retrying("rollouts step 4", _eperm, 0.05, first_s=0.01))
    assert str(gone.value).startswith("cannot write rollouts step 4 for 0 s: not writable (operation not")
    assert "/r/rollouts/step_4" in str(gone.value) and "(storage_timeout_s = 0.05)" in str(gone.value)


def _eperm() -> None:
    raise PermissionError(errno.EPERM, "Operation not permitted", "/r/rollouts/step_4")


def test_a_real_unwritable_dir_is_waited_out_from_a_clean_start(tmp_path: Path, caplog) -> None:
    """broadcasts/ immutable for 1 s while the trainer publishes policy 2 (a real EPERM, or EACCES as
    a user): named once with the errno and the free space, retried, written whole; policy 1 untouched."""
    import torch

    from hpcrl.paths import RunPaths
    from hpcrl.trainer.publish import PolicyPublisher

    paths = RunPaths(tmp_path / "run")
    pub = PolicyPublisher(paths, bus=None, rank=0, transport="filesystem", keep=2, storage_timeout_s=60)
    named = {"w": torch.arange(6, dtype=torch.float32)}
    pub._write_files(1, named, None)
    how, undo = _make_unwritable(paths.broadcasts_dir)
    clear = threading.Timer(0.5, lambda: subprocess.run(undo, check=True))  # well before the 1 s try
    t0 = time.monotonic()
    try:
        clear.start()
        with caplog.at_level(logging.WARNING, "hpcrl.storage"):
            assert pub._write_files(2, {"w": named["w"] * 2}, None) == paths.broadcast_dir(2)
    finally:
        clear.cancel()
        subprocess.run(undo, check=False)
    took = time.monotonic() - t0
    assert 1.0 <= took < 5, took  # tries at 0 (refused while immutable) and 1 s; at 3 s if clearing was late
    lines = [r.getMessage() for r in caplog.records if r.name == "hpcrl.storage"]
    assert lines[0].startswith("trainer: cannot write policy 2: not writable (") and len(lines) == 2, lines
    assert str(paths.broadcasts_dir) in lines[0] and " free of " in lines[0], (how, lines)
    assert ("EPERM" if how == "chattr +i" else "EACCES") in lines[0]
    from safetensors.torch import load_file

    assert load_file(str(paths.broadcast_dir(1) / "model.safetensors"))["w"].tolist() == [0, 1, 2, 3, 4, 5]
    assert load_file(str(paths.broadcast_dir(2) / "model.safetensors"))["w"].tolist() == [0, 2, 4, 6, 8, 10]
    assert sorted(p.name for p in paths.broadcasts_dir.iterdir()) == ["step_1", "step_2"]  # no tmp left


@pytest.fixture
def full_disk(tmp_path: Path):
    d = tmp_path / "small"
    why = _mount_tmpfs(d, "1m")
    if why is not None:
        pytest.skip(why)
    filler = Filler(d)
    try:
        yield d, filler
    finally:
        if not filler.done.is_set():
            filler.stop()
        subprocess.run(["umount", "-l", str(d)], check=False)


def test_a_real_full_disk_ends_the_writer_in_one_line_past_the_bound(full_disk) -> None:
    d, _ = full_disk
    with pytest.raises(WriteRefused) as got:
        retry_blocking(
            "sft trainer", "checkpoint step 5", lambda: fileio.write_text(d / "a", "x" * 9000), 0.3
        )
    line = str(got.value)
    # the wait past a 0.3 s bound: "0 s", or "1 s" on a loaded machine
    assert re.match(
        rf"cannot write checkpoint step 5 for [01] s: disk full at {re.escape(str(d / 'a'))} \(No space left",
        line,
    ), line
    assert line.endswith("ENOSPC; free space there: 0 B free of 1.0 MB (storage_timeout_s = 0.3)"), line
    assert [p.name for p in d.iterdir()] == ["filler"]  # the refused write left nothing behind


def test_the_metrics_file_holds_its_lines_while_the_disk_is_full(full_disk, caplog) -> None:
    from hpcrl.monitor.metrics import JsonlSink, read_metrics

    d, filler = full_disk
    sink = JsonlSink(d / "metrics.jsonl", "trainer", timeout_s=60)
    with caplog.at_level(logging.WARNING, "hpcrl.storage"):
        sink.write({"step": 1})  # refused: held, named
        sink.write({"step": 2})  # within the first 1 s wait: held without a try
        filler.stop()
        time.sleep(1.05)
        sink.write({"step": 3})  # the wait is over: all three, in order
    sink.close()
    assert [r["step"] for r in read_metrics(d / "metrics.jsonl")] == [1, 2, 3]
    lines = [r.getMessage() for r in caplog.records if r.name == "hpcrl.storage"]
    assert (
        lines[0].startswith("trainer: cannot write metrics (1 line(s) held): disk full at ")
        and len(lines) == 2
    )
    # 1 s after the refusal; 2 s where stopping the filler (a thread mid top-up) was slow
    assert re.match(r"trainer: wrote metrics \(1 line\(s\) held\) after [12] s", lines[1]), lines[1]


def test_a_log_the_disk_refuses_never_raises_and_says_what_it_lost() -> None:
    class Stream:
        full, text = True, ""

        def write(self, s: str) -> None:
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.text += s

        def flush(self) -> None:
            pass

    stream = Stream()
    before = storage.dropped_log_lines()[0]
    handler = storage.TolerantStreamHandler(stream)
    logger = logging.getLogger("test.tolerant")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("one")
        logger.warning("two")
        stream.full = False
        logger.warning("three")
    finally:
        logger.removeHandler(handler)
    assert (
        stream.text == "2 log line(s) lost: disk full at an unnamed file (No space left on device)\nthree\n"
    )
    # the process's count, which an env server's Pong tells the orchestrator (its console, status)
    assert storage.dropped_log_lines() == (
        before + 2,
        "disk full at an unnamed file (No space left on device)",
    )


def _policy(step: int):
    from hpcrl.bus.messages import PolicyReady

    return PolicyReady(step=step, transport="collective", checksum=f"c{step}", num_params=1, num_bytes=4)


def test_the_trainers_policy_announcement_waits_out_an_unwritable_policy_dir(tmp_path, caplog) -> None:
    """policy/ unwritable for ~1 s: the trainer's bus names it once, retries and publishes when it
    clears; with no time to wait (storage_timeout_s = 0) the refusal is the one line at once."""
    from hpcrl.bus.api import Bus
    from hpcrl.paths import RunPaths

    paths = RunPaths(tmp_path / "run")
    bus = Bus(paths, role="trainer", listen=False, storage_timeout_s=60)
    how, undo = _make_unwritable(paths.policy_dir)
    clear = threading.Timer(1.0, lambda: subprocess.run(undo, check=True))
    try:
        clear.start()
        with caplog.at_level(logging.WARNING, "hpcrl.storage"):
            assert bus.publish_policy(_policy(3)) == paths.policy_file(3)
        assert bus.latest_policy().step == 3
        lines = [r.getMessage() for r in caplog.records if r.name == "hpcrl.storage"]
        assert (
            lines[0].startswith("trainer_0: cannot write policy step 3: not writable (") and len(lines) == 2
        )
        assert str(paths.policy_dir) in lines[0] and "for up to 60 s (storage_timeout_s)" in lines[0], how
        assert lines[1].startswith("trainer_0: wrote policy step 3 after")
        _make_unwritable(paths.policy_dir)
        impatient = Bus(paths, role="trainer", listen=False)  # storage_timeout_s = 0: no waiting
        with pytest.raises(WriteRefused) as got:
            impatient.publish_policy(_policy(4))
        assert str(got.value).startswith("cannot write policy step 4 for 0 s: not writable (")
        assert str(got.value).endswith("(storage_timeout_s = 0)")
    finally:
        clear.cancel()
        subprocess.run(undo, check=False)


def test_an_fd_relative_name_is_named_under_its_directory(tmp_path: Path) -> None:
    """shutil.rmtree removes entries through a directory fd, so its OSError names `manifest.json`
    alone (the CI failure of stop 55: `read-only filesystem at manifest.json`). The line names the
    whole path: the file under the directory written, else the directory."""
    import shutil

    d = tmp_path / "broadcasts" / "step_90"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text("{}")
    _, undo = _make_unwritable(d)  # its entries cannot be removed
    try:
        with pytest.raises(OSError) as e:
            shutil.rmtree(d)
    finally:
        subprocess.run(undo, check=True)
    assert e.value.filename == "manifest.json"  # what the kernel call was given
    err = fileio.refused_error(e.value, d)
    assert err is not None and err.filename == str(d / "manifest.json")
    assert fileio.refused_error(OSError(errno.EROFS, "x", "gone.json"), d).filename == str(d)
    assert fileio.refused_error(OSError(errno.EROFS, "x", "/abs/f"), d).filename == "/abs/f"
    assert fileio.refused_error(OSError(errno.EROFS, "x"), d).filename == str(d)
