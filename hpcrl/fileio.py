"""Atomic, durable file writes: the one home of write-then-rename in hpcrl.

Protocol: `name.tmp-<pid>-<host>` in the destination directory, write every part, fsync, rename onto
`name`, fsync the directory. rename(2) is atomic on POSIX filesystems and Lustre, so a reader sees
either no file (or the old one) or the whole new file; the directory fsync makes the rename itself
survive a node crash. The host in the tmp name lets a cleaner tell a dead local writer (pid gone) from
a live writer on another node that happens to reuse the pid. Bus messages (hpcrl.bus.files),
checkpoints, resolved configs, datasets, model directories and side files all write through here.

Stdlib only: config loading and `--help` import it without numpy or msgspec.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("hpcrl.fileio")

TMP_MARK = ".tmp-"
_HOST = socket.gethostname().replace("-", "_")  # keeps "<pid>-<host>" splittable


def tmp_name(path: Path) -> Path:
    """`<name>.tmp-<pid>.<thread>-<host>`: unique per writing thread (two threads of one process may
    write the same file: the last rename wins, neither loses its tmp to the other's rename)."""
    return path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}.{threading.get_native_id()}-{_HOST}")


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
    renamed_at = write_renamed(path, parts, durable=durable)
    if durable:
        fsync_dir(path.parent)
    return renamed_at


def write_renamed(path: Path, parts: list[Any], *, durable: bool = True) -> float:
    """write_atomic without its directory steps: the parent must exist, and the caller fsyncs it
    (once for many files: hpcrl.bus publishes a step's files this way). Until that fsync the rename
    may not survive a node crash; the file's content is durable and a reader sees all or nothing.
    Returns time.time() right after the rename."""
    tmp = tmp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for part in parts:
                _write_all(fd, part)
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.filename is None:  # write(2)/fsync(2) name no file: name it
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    return time.time()


# A write the filesystem refused for a reason outside the program: each errno and what it means.
REFUSED = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file size limit exceeded",
    errno.EACCES: "not writable (permission denied)",
    errno.EPERM: "not writable (operation not permitted)",
    errno.EROFS: "read-only filesystem",
    errno.EIO: "I/O error (the storage failed the write)",
}
_OS_ERROR = re.compile(r"\(os error (\d+)\)|Os \{ code: (\d+)")  # how Rust's std::io::Error prints
_RUST_IO = {
    "StorageFull": errno.ENOSPC,
    "QuotaExceeded": errno.EDQUOT,
    "PermissionDenied": errno.EACCES,
    "ReadOnlyFilesystem": errno.EROFS,
}


def refused_error(e: BaseException, path: Path | str | None = None) -> OSError | None:
    """`e` as a plain OSError naming its file when it is a write the filesystem refused (REFUSED),
    else None. Also reads Rust I/O errors that libraries wrap (safetensors: `I/O error: No space left
    on device (os error 28)`, `Os { code: 28, kind: StorageFull }`). `path` stands in when `e` names
    no file."""
    code = e.errno if isinstance(e, OSError) else None
    if code is None:
        text = str(e)
        m = _OS_ERROR.search(text)
        code = (
            int(m.group(1) or m.group(2))
            if m
            else next((c for kind, c in _RUST_IO.items() if kind in text), None)
        )
    if code not in REFUSED:
        return None
    where = _where(getattr(e, "filename", None), path)
    return OSError(code, os.strerror(code), None if where is None else str(where))


def _where(filename: Any, path: Path | str | None) -> Any:
    """The file to name: `filename` as the error gave it, but an fd-relative name (shutil.rmtree and
    os.unlink(dir_fd=) give `manifest.json`) is resolved under `path`, or `path` itself stands in."""
    if filename is None or path is None or os.path.isabs(str(filename)):
        return filename if filename is not None else path
    inside = Path(path) / str(filename)
    return str(inside) if inside.exists() else str(path)


class WriteRefused(OSError):
    """A write the filesystem kept refusing past storage_timeout_s (hpcrl.storage, the one policy
    every role follows): str() is the one line the role ends with."""

    def __str__(self) -> str:
        return str(self.strerror)


def refused_write(e: BaseException, path: Path | str | None = None) -> str | None:
    """`disk full at PATH (No space left on device)` for a refused write (refused_error), else None;
    a WriteRefused is its own line."""
    if isinstance(e, WriteRefused):
        return str(e)
    err = refused_error(e, path)
    if err is None:
        return None
    return f"{REFUSED[err.errno]} at {err.filename or 'an unnamed file'} ({err.strerror})"


def _write_all(fd: int, part: Any) -> None:
    mv = memoryview(part).cast("B")
    while mv:
        n = os.write(fd, mv)  # regular files normally take it all; loop for >2 GiB and signals
        mv = mv[n:]


def write_text(path: Path, text: str, *, durable: bool = True) -> float:
    """write_atomic for one str (UTF-8)."""
    return write_atomic(path, [text.encode()], durable=durable)


def fsync_file(path: Path) -> None:
    """Make an already written file's data durable (files written by libraries, e.g. torch.save)."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


class atomic_dir:
    """``with atomic_dir(final) as tmp:`` fill ``tmp``; on success it replaces ``final`` by rename.

    A reader sees the old directory or the complete new one, never a half-written one; on an error
    the tmp directory is removed and ``final`` is untouched."""

    def __init__(self, final: Path) -> None:
        self.final = Path(final)
        self.tmp = self.final.parent / f".{self.final.name}.tmp-{os.getpid()}"

    def __enter__(self) -> Path:
        self.final.parent.mkdir(parents=True, exist_ok=True)
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()
        return self.tmp

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        for f in self.tmp.iterdir():
            fsync_dir(f)
        fsync_dir(self.tmp)
        old = None
        if self.final.exists():
            # A directory cannot be atomically replaced by rename; move the old one aside first.
            old = self.final.parent / f".{self.final.name}.old-{os.getpid()}"
            os.replace(self.final, old)
        try:
            os.replace(self.tmp, self.final)
        except BaseException:
            if old is not None:  # the previous directory stays where readers look for it
                os.replace(old, self.final)
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        fsync_dir(self.final.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


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
    writer, _, host = suffix.partition("-")
    pid_str = writer.split(".", 1)[0]  # <pid>.<thread>; names of before: <pid>
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
