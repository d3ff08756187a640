"""Atomic, durable bus files: the file is the message.

Write protocol: `name.tmp-<pid>-<host>` in the destination directory, write every part, fsync,
rename onto `name`, fsync the directory. rename(2) is atomic on POSIX filesystems and Lustre, so a
reader sees either no file or the whole file; the directory fsync makes the rename itself survive a
node crash. The host in the tmp name lets a cleaner tell a dead local writer (pid gone) from a live
writer on another node that happens to reuse the pid.

Readers never open `*.tmp-*` names. A final-named file that still fails its checks (truncated by a
broken filesystem, bit rot, a stray file from another program) raises CorruptMessageError naming the
path; consumers move it into RunPaths.rejected_dir with `reject()` and keep going.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, as_completed
from pathlib import Path
from typing import Any

import numpy as np

from hpcrl.bus.errors import CorruptMessageError
from hpcrl.bus.messages import DEFAULT_CHECKSUM, M, Message, decode, decode_json, encode_parts
from hpcrl.fileio import (  # noqa: F401 (re-exported: the bus's write protocol is the file-I/O module's)
    TMP_MARK,
    clean_stale_tmp,
    ensure_dir,
    fsync_dir,
    is_tmp,
    tmp_name,
    write_atomic,
    write_renamed,
)

log = logging.getLogger("hpcrl.bus")


def write_message(
    path: Path, msg: Message, *, checksum: str = DEFAULT_CHECKSUM, durable: bool = True
) -> float:
    """Frame `msg` and write it atomically (array bytes go straight from numpy to the kernel)."""
    return write_atomic(path, encode_parts(msg, checksum=checksum), durable=durable)


def write_messages(
    items: Sequence[tuple[Path, Message]],
    pool: Executor,
    *,
    checksum: str = DEFAULT_CHECKSUM,
    durable: bool = True,
    on_renamed: Callable[[int, float], None] | None = None,
) -> list[float]:
    """write_message for several distinct paths at once; returns each one's rename time.

    Same guarantees per file as write_message (tmp, fsync, rename: all or nothing for a reader), but
    the files are framed, written and fsynced by `pool`'s threads, so their fsyncs overlap, and each
    parent directory is fsynced once after the last rename instead of once per file. `on_renamed(i,
    t)` runs in the calling thread as item i lands (zmq sockets are not thread-safe: ring there).
    If a write fails, the others still finish before the first error is raised: every renamed file
    is complete and the rest are absent, so publishing the same items again completes the set.
    """
    for d in dict.fromkeys(p.parent for p, _ in items):
        ensure_dir(d)

    def one(path: Path, msg: Message) -> float:
        return write_renamed(path, encode_parts(msg, checksum=checksum), durable=durable)

    futures = {pool.submit(one, path, msg): i for i, (path, msg) in enumerate(items)}
    renamed_at = [0.0] * len(items)
    error: BaseException | None = None
    for fut in as_completed(futures):
        i = futures[fut]
        if (e := fut.exception()) is not None:
            error = error or e
            continue
        renamed_at[i] = fut.result()
        if on_renamed is not None:
            on_renamed(i, renamed_at[i])
    if error is not None:
        raise error
    if durable:
        for d in dict.fromkeys(p.parent for p, _ in items):
            fsync_dir(d)
    return renamed_at


def read_bytes(path: Path) -> tuple[np.ndarray, int]:
    """The whole file in one fresh, writable uint8 buffer (np.empty: no zero-fill pass), and its inode."""
    with open(path, "rb", buffering=0) as f:
        st = os.fstat(f.fileno())
        size = st.st_size
        buf = np.empty(size, dtype=np.uint8)
        mv = memoryview(buf)
        got = 0
        while got < size:
            n = f.readinto(mv[got:])
            if not n:
                break
            got += n
    if got < size:
        raise CorruptMessageError(f"file shrank while reading ({got} of {size} bytes)", path, st.st_ino)
    return buf, st.st_ino


def read_message(path: Path, type: type[M] | None = None) -> M:
    """Read and decode one bus file. Arrays are zero-copy, writable views of the read buffer.

    FileNotFoundError if absent; CorruptMessageError (naming `path`) if it fails any check.
    """
    buf, inode = read_bytes(path)
    try:
        return decode(buf, type)
    except CorruptMessageError as e:
        raise e.with_path(path, inode) from None


def decode_json_file(path: Path, type: type[Any]) -> Any:
    """A small JSON side file (endpoint, server address); CorruptMessageError names the path."""
    try:
        return decode_json(path.read_bytes(), type)
    except CorruptMessageError as e:
        raise e.with_path(path) from None


def try_read(path: Path, type: type[M] | None = None) -> M | None:
    """read_message, or None when the file is not there (yet, or no more)."""
    try:
        return read_message(path, type)
    except FileNotFoundError:
        return None


def reject(path: Path, rejected_dir: Path, root: Path | None = None, inode: int | None = None) -> Path | None:
    """Move a corrupt file aside so it is never read again; returns where it went.

    The new name keeps the path relative to `root` (slashes -> '__') plus a timestamp, so one look
    at rejected/ says which message was bad and when. None if someone else moved it first, or if
    `inode` is given and the file at `path` is no longer that one (a writer replaced it since).
    """
    try:
        if inode is not None and os.stat(path).st_ino != inode:
            return None
    except FileNotFoundError:
        return None
    ensure_dir(rejected_dir)
    try:
        rel = path.relative_to(root) if root is not None else Path(path.name)
    except ValueError:
        rel = Path(path.name)
    dest = rejected_dir / f"{'__'.join(rel.parts)}.{time.time_ns()}"
    try:
        os.replace(path, dest)
    except FileNotFoundError:
        return None
    fsync_dir(rejected_dir)
    return dest


# rollouts/step_N/<split>/: every rollout saved for people (hpcrl.orchestrator.rollout_log), beside
# the bus batches and kept by its own retention: the bus's cleanup and move-aside leave them alone.
SAVED_SPLITS = ("train", "eval")


def bus_entries(step_dir: Path) -> list[Path] | None:
    """The bus's entries of a step directory (batches, their tmp files); None when it holds nothing
    else (it can go whole)."""
    try:
        entries = list(step_dir.iterdir())
    except FileNotFoundError:
        return []
    if not any(p.name in SAVED_SPLITS for p in entries):
        return None
    return [p for p in entries if p.name not in SAVED_SPLITS]


def remove_bus_part(step_dir: Path) -> None:
    """Delete a step directory's bus files, or the whole directory when it holds nothing else. A
    deletion the filesystem refuses (read-only, not writable: hpcrl.fileio.refused_error) is left for
    the next cleanup: a cleanup is never worth the role that makes it."""
    from hpcrl.fileio import refused_error

    entries = bus_entries(step_dir)
    for p in [step_dir] if entries is None else entries:
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
            continue
        try:
            p.unlink(missing_ok=True)
        except OSError as e:
            if refused_error(e, p) is None:
                raise
