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

import errno
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np

from hpcrl.bus.errors import CorruptMessageError
from hpcrl.bus.messages import DEFAULT_CHECKSUM, M, Message, decode, decode_json, encode_parts

log = logging.getLogger("hpcrl.bus")

TMP_MARK = ".tmp-"
_HOST = socket.gethostname().replace("-", "_")  # keeps "<pid>-<host>" splittable


def tmp_name(path: Path) -> Path:
    return path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}-{_HOST}")


def is_tmp(path: Path | str) -> bool:
    return TMP_MARK in Path(path).name


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some network filesystems refuse fsync on a directory; rename is still atomic
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def ensure_dir(directory: Path) -> None:
    """mkdir -p that also makes a freshly created directory's entry durable."""
    if directory.is_dir():
        return
    ensure_dir(directory.parent)
    try:
        directory.mkdir()
    except FileExistsError:
        return
    fsync_dir(directory.parent)


def write_atomic(path: Path, parts: list[Any], *, durable: bool = True) -> float:
    """Write the concatenation of `parts` to `path` atomically. Returns time.time() right after rename."""
    ensure_dir(path.parent)
    tmp = tmp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            for part in parts:
                _write_all(fd, part)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    renamed_at = time.time()
    if durable:
        fsync_dir(path.parent)
    return renamed_at


def _write_all(fd: int, part: Any) -> None:
    mv = memoryview(part).cast("B")
    while mv:
        n = os.write(fd, mv)  # regular files normally take it all; loop for >2 GiB and signals
        mv = mv[n:]


def write_message(
    path: Path, msg: Message, *, checksum: str = DEFAULT_CHECKSUM, durable: bool = True
) -> float:
    """Frame `msg` and write it atomically (array bytes go straight from numpy to the kernel)."""
    return write_atomic(path, encode_parts(msg, checksum=checksum), durable=durable)


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


def clean_stale_tmp(directory: Path, *, max_age: float = 600.0, recursive: bool = False) -> list[Path]:
    """Delete leftover tmp files of dead writers. Returns the deleted paths.

    A tmp file is stale if its writer ran on this host and its pid is gone, or (writer elsewhere or
    name unparsable) if it has not been modified for `max_age` seconds.
    """
    removed: list[Path] = []
    if not directory.is_dir():
        return removed
    entries = directory.rglob(f"*{TMP_MARK}*") if recursive else directory.glob(f"*{TMP_MARK}*")
    now = time.time()
    for p in entries:
        try:
            stale = _writer_dead(p.name) or now - p.stat().st_mtime > max_age
            if stale:
                p.unlink()
                removed.append(p)
        except FileNotFoundError:
            continue
    if removed:
        log.info("removed %d stale tmp file(s) under %s", len(removed), directory)
    return removed


def _writer_dead(name: str) -> bool:
    suffix = name.rsplit(TMP_MARK, 1)[-1]
    pid_str, _, host = suffix.partition("-")
    if host != _HOST or not pid_str.isdigit():
        return False
    pid = int(pid_str)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, owned by someone else
        return False
    return _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    # A killed child that its parent has not reaped yet still answers kill(pid, 0).
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[-1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False
