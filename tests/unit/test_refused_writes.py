"""A write the filesystem refuses (disk full, not writable) is named with its path and cause; the
orchestrator's bus writes retry it and give up in one line (issue 40)."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from pathlib import Path

import pytest

from hpcrl import fileio
from hpcrl.orchestrator.writes import WriteRefused, write_retrying


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
    assert (
        fileio.refused_write(FileNotFoundError(errno.ENOENT, "gone", "/x")) is None
    )  # a bug, not a full disk
    assert fileio.refused_write(ValueError("bad")) is None


def test_write_retrying_names_the_refusal_once_and_goes_on_when_it_clears(caplog) -> None:
    tries = []

    def write() -> str:
        tries.append(1)
        if len(tries) < 4:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/r/rollouts/step_3/rank_0.msgpack")
        return "done"

    with caplog.at_level(logging.WARNING, "hpcrl.orchestrator"):
        assert asyncio.run(write_retrying("rollouts step 3", write, give_up_s=30, every_s=0.01)) == "done"
    lines = [r.getMessage() for r in caplog.records]
    assert len(tries) == 4
    assert lines[0].startswith(
        "orchestrator: cannot write rollouts step 3: disk full at /r/rollouts/step_3/rank_0.msgpack"
    )
    assert lines[1].startswith("orchestrator: wrote rollouts step 3 after") and len(lines) == 2


def test_write_retrying_gives_up_in_one_line_past_its_bound_and_passes_other_errors_on() -> None:
    def refused() -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted", "/r/rollouts/step_4")

    with pytest.raises(WriteRefused) as got:
        asyncio.run(write_retrying("rollouts step 4", refused, give_up_s=0.05, every_s=0.01))
    assert str(got.value).startswith(
        "cannot write rollouts step 4 for 0 s: not writable (operation not permitted)"
    )
    assert "/r/rollouts/step_4" in str(got.value)

    def bug() -> None:
        raise FileNotFoundError(errno.ENOENT, "No such file", "/nowhere")

    with pytest.raises(FileNotFoundError):
        asyncio.run(write_retrying("x", bug, give_up_s=30, every_s=0.01))


def _policy(step: int):
    from hpcrl.bus.messages import PolicyReady

    return PolicyReady(step=step, transport="collective", checksum=f"c{step}", num_params=1, num_bytes=4)


def test_the_trainers_policy_publish_waits_out_an_unwritable_policy_dir(tmp_path, caplog) -> None:
    """policy/ unwritable for ~2 s (chattr +i as root, chmod 0555 as a user: a real refusal by the
    filesystem): the trainer names it at once, retries, and publishes when it clears; with no time to
    wait the refusal is one line (what, how long, cause and path)."""
    import subprocess
    import threading

    from hpcrl.bus.api import Bus
    from hpcrl.fileio import WriteRefused
    from hpcrl.paths import RunPaths
    from tests.integration.faults import _make_unwritable

    paths = RunPaths(tmp_path / "run")
    bus = Bus(paths, role="trainer", listen=False, refused_retry_s=60)
    how, undo = _make_unwritable(paths.policy_dir)
    clear = threading.Timer(2.0, lambda: subprocess.run(undo, check=True))
    try:
        clear.start()
        with caplog.at_level(logging.WARNING, "hpcrl.bus"):
            assert bus.publish_policy(_policy(3)) == paths.policy_file(3)
        assert bus.latest_policy().step == 3
        lines = [r.getMessage() for r in caplog.records]
        assert (
            lines[0].startswith("trainer_0: cannot write policy step 3: not writable (")
            and str(paths.policy_dir) in lines[0]
        ), (how, lines)
        assert "retrying every 1 s for up to 60 s (orchestrator.policy_timeout_s)" in lines[0]
        assert lines[1].startswith("trainer_0: wrote policy step 3 after") and len(lines) == 2
        _make_unwritable(paths.policy_dir)
        impatient = Bus(paths, role="trainer", listen=False)  # refused_retry_s = 0: no waiting
        with pytest.raises(WriteRefused) as got:
            impatient.publish_policy(_policy(4))
        assert str(got.value).startswith("cannot write policy step 4 for 0 s: not writable (")
        assert fileio.refused_write(got.value) == str(got.value)  # the trainer's last line
    finally:
        clear.cancel()
        subprocess.run(undo, check=False)
