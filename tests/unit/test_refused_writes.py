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
