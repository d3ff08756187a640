"""Atomic durable writes, rejection of corrupt files, and cleaning of dead writers' tmp files."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from hpcrl import fileio
from hpcrl.bus import CorruptMessageError, Shutdown, TrainBatch, read_message, write_message
from hpcrl.bus import files as f
from tests.unit.test_bus_messages import assert_same_batch, make_batch


def test_write_read_round_trip_leaves_no_tmp(tmp_path):
    path = tmp_path / "a" / "b" / "rank_0.msgpack"
    batch = make_batch(step=2)
    renamed_at = write_message(path, batch)
    assert abs(renamed_at - time.time()) < 5
    assert sorted(p.name for p in path.parent.iterdir()) == ["rank_0.msgpack"]
    out = read_message(path, TrainBatch)
    assert_same_batch(batch, out)
    out.advantages[:] = 0  # writable: the trainer may normalise in place


def test_failed_write_removes_its_tmp_and_keeps_the_old_file(tmp_path):
    path = tmp_path / "x.msgpack"
    write_message(path, Shutdown(reason="old", origin="t"))
    with pytest.raises(TypeError):
        f.write_atomic(path, [b"partial", object()])  # second part is not a buffer
    assert [p.name for p in tmp_path.iterdir()] == ["x.msgpack"]
    assert read_message(path, Shutdown).reason == "old"


def test_corrupt_file_error_names_the_path_and_reject_moves_it(tmp_path):
    path = tmp_path / "rollouts" / "step_3" / "rank_1.msgpack"
    write_message(path, make_batch(step=3, rank=1, world_size=2))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(data)
    with pytest.raises(CorruptMessageError, match="checksum mismatch") as info:
        read_message(path, TrainBatch)
    assert info.value.path == path and str(path) in str(info.value)
    dest = f.reject(path, tmp_path / "rejected", tmp_path, inode=info.value.inode)
    assert dest is not None and dest.name.startswith("rollouts__step_3__rank_1.msgpack.")
    assert not path.exists() and dest.read_bytes() == data
    assert f.reject(path, tmp_path / "rejected", tmp_path) is None  # already gone: no error


def test_reject_never_moves_a_replacement(tmp_path):
    path = tmp_path / "p.msgpack"
    path.write_bytes(b"garbage")
    with pytest.raises(CorruptMessageError) as info:
        read_message(path)
    write_message(path, Shutdown(reason="fresh", origin="w"))  # the writer republished meanwhile
    assert f.reject(path, tmp_path / "rejected", inode=info.value.inode) is None
    assert read_message(path, Shutdown).reason == "fresh"


def test_empty_and_header_only_files_are_corrupt(tmp_path):
    for n, content in enumerate([b"", b"HPCRLBUS", write_bytes_prefix(48)]):
        p = tmp_path / f"{n}.msgpack"
        p.write_bytes(content)
        with pytest.raises(CorruptMessageError, match="truncated|not a bus file") as info:
            read_message(p)
        assert info.value.path == p


def write_bytes_prefix(n: int) -> bytes:
    from hpcrl.bus import encode

    return encode(make_batch())[:n]


def test_stale_tmp_cleaning(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = fileio._HOST  # the tmp-name protocol lives in hpcrl.fileio
    dead_tmp = tmp_path / f"rank_0.msgpack{f.TMP_MARK}{dead.pid}-{host}"
    live_tmp = tmp_path / f"rank_1.msgpack{f.TMP_MARK}{os.getppid()}-{host}"
    remote_tmp = tmp_path / f"rank_2.msgpack{f.TMP_MARK}{dead.pid}-some_other_node"
    old_remote_tmp = tmp_path / f"rank_3.msgpack{f.TMP_MARK}{dead.pid}-some_other_node"
    dead_thread_tmp = tmp_path / f"rank_4.msgpack{f.TMP_MARK}{dead.pid}.4242-{host}"  # <pid>.<thread>
    live_thread_tmp = tmp_path / f"rank_5.msgpack{f.TMP_MARK}{os.getppid()}.4242-{host}"
    for p in (dead_tmp, live_tmp, remote_tmp, old_remote_tmp, dead_thread_tmp, live_thread_tmp):
        p.write_bytes(b"half a file")
    os.utime(old_remote_tmp, (time.time() - 3600, time.time() - 3600))
    removed = f.clean_stale_tmp(tmp_path, max_age=600)
    assert sorted(removed) == sorted([dead_tmp, old_remote_tmp, dead_thread_tmp])
    assert live_tmp.exists() and remote_tmp.exists() and live_thread_tmp.exists()
    assert fileio.tmp_name(tmp_path / "x").name.startswith(f"x{f.TMP_MARK}{os.getpid()}.")
    assert f.is_tmp(live_tmp) and not f.is_tmp(tmp_path / "rank_0.msgpack")


def test_large_arrays_go_to_disk_without_an_encode_copy(tmp_path):
    arr = np.arange(1 << 20, dtype=np.int32)
    batch = make_batch(samples=1, sample_len=1 << 20, input_ids=arr)
    parts = f.encode_parts(batch)
    assert any(isinstance(p, memoryview) and np.shares_memory(np.asarray(p), arr) for p in parts)


def test_two_threads_writing_one_file_never_take_each_others_tmp(tmp_path):
    """The progress thread and a nudge, a finaliser and the main loop: each writer's tmp is its own,
    so a rename never finds its tmp already renamed by the other thread (FileNotFoundError)."""
    import threading

    target, errors = tmp_path / "progress.json", []

    def writer(tag: str) -> None:
        try:
            for i in range(300):
                fileio.write_text(target, f"{tag} {i}", durable=False)
        except OSError as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert target.read_text() in {"a 299", "b 299"}
    assert not [p for p in tmp_path.iterdir() if f.is_tmp(p)]
