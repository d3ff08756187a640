"""One storage policy for every role: what a write does when the filesystem refuses it.

A full disk, a quota, a directory made read-only or a storage server that errors (fileio.REFUSED:
ENOSPC, EDQUOT, EROFS, EIO, ...) is routine on shared filesystems and is often fixed within minutes.
So every role (trainer, SFT trainer, orchestrator) treats such a write the same way:

1. named once at WARNING: the role, what was written, the path, the errno and the free space of
   that filesystem (os.statvfs; "unknown" when it cannot say);
2. retried with backoff: FIRST_WAIT_S, doubling, at most MAX_WAIT_S between tries;
3. past `storage_timeout_s` (the run config's one field): WriteRefused, whose str() is the one line
   the role ends with (what, path, cause, for how long, the field).

A retried write must start over cleanly: fileio.write_atomic and fileio.atomic_dir write under a tmp
name and rename last, so an attempt cut short leaves nothing a reader takes for complete.

Logs are never worth a role: `TolerantFileHandler` / `TolerantStreamHandler` drop what the filesystem
refuses and say how many lines were lost once they can write again (env servers, env log files), and
`tolerate_std_streams` does the same for whatever else writes a role's stdout/stderr (a progress
bar while a model loads, a print, a library's warning): a role whose log is full keeps running.

Faces: `retry_blocking` (trainer publish and checkpoints, the trainer's bus writes), `retry_async`
(the orchestrator's event loop: its batches and its checkpoint part) and `retry_together` (a write
that every trainer rank makes at once, collectives inside or a decision after); all keep their books
in `Refusals`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from hpcrl.fileio import WriteRefused, refused_error, refused_write

log = logging.getLogger("hpcrl.storage")

FIELD = "storage_timeout_s"
DEFAULT_TIMEOUT_S = 600.0
FIRST_WAIT_S = 1.0
MAX_WAIT_S = 30.0
T = TypeVar("T")

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "FIELD",
    "Refusals",
    "TolerantFileHandler",
    "TolerantStreamHandler",
    "WriteRefused",
    "backoff",
    "describe",
    "open_log",
    "free_space",
    "report_to",
    "retry_async",
    "retry_blocking",
    "retry_together",
    "tolerate_std_streams",
]


def backoff(first_s: float = FIRST_WAIT_S, cap_s: float = MAX_WAIT_S) -> Iterator[float]:
    """1, 2, 4, 8, 16, 30, 30, ... seconds (with the defaults)."""
    wait = first_s
    while True:
        yield min(wait, cap_s)
        wait *= 2


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def free_space(path: Path | str | None) -> str:
    """`12.3 MB free of 64.0 MB` for the filesystem holding `path` (its nearest existing ancestor),
    `unknown` when statvfs cannot say."""
    if path is None:
        return "unknown"
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return "unknown"
    return f"{_size(st.f_bavail * st.f_frsize)} free of {_size(st.f_blocks * st.f_frsize)}"


def describe(e: BaseException, path: Path | str | None = None) -> str | None:
    """`disk full at PATH (No space left on device), ENOSPC; free space there: 0 B free of 64.0 MB`
    for a write the filesystem refused (fileio.refused_error), else None."""
    err = refused_error(e, path)
    if err is None:
        return None
    return f"{_cause(err)}; free space there: {free_space(err.filename)}"


def _cause(err: OSError) -> str:
    return f"{refused_write(err)}, {errno.errorcode.get(err.errno, str(err.errno))}"


class Refusals:
    """The books of one write retried while the filesystem refuses it.

    `refused(e)` after each failed attempt: names the cause once (again only when the errno or the path
    changes), returns the seconds to wait before the next try (the backoff, never past the bound),
    raises `e` itself when it is not a refusal and WriteRefused once `timeout_s` has passed since the
    first refusal. `cleared()` after the write went through (one line when one was named)."""

    def __init__(
        self,
        role: str,
        what: str,
        timeout_s: float,
        *,
        path: Path | str | None = None,
        first_s: float = FIRST_WAIT_S,
        cap_s: float = MAX_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.role, self.what, self.timeout_s, self.path = role, what, timeout_s, path
        self.first_s, self.cap_s = first_s, cap_s
        self.clock = clock
        self.t0: float | None = None
        self.named: str | None = None  # the cause last named
        self._key: tuple[int, str | None] | None = None
        self._waits = backoff(first_s, cap_s)

    def waited(self) -> float:
        return 0.0 if self.t0 is None else self.clock() - self.t0

    def refused(self, e: BaseException) -> float:
        err = refused_error(e, self.path)
        if err is None:
            raise e
        now = self.clock()
        if self.t0 is None:
            self.t0 = now
        waited = now - self.t0
        why = _cause(err)
        if waited >= self.timeout_s:
            raise WriteRefused(
                err.errno,
                f"cannot write {self.what} for {waited:.0f} s: {why}; free space there: "
                f"{free_space(err.filename)} ({FIELD} = {self.timeout_s:g})",
                err.filename,
            ) from e
        key = (err.errno, err.filename)
        if key != self._key:
            self._key, self.named = key, why
            log.warning(
                "%s: cannot write %s: %s; free space there: %s; retrying in %g s, doubling to %g s, "
                "for up to %g s (%s)",
                self.role, self.what, why, free_space(err.filename), self.first_s, self.cap_s,
                self.timeout_s, FIELD,
            )  # fmt: skip
            _progress_waiting(self.what, f"writing {self.what}: {why}")
        return max(0.0, min(next(self._waits), self.timeout_s - waited))

    def cleared(self) -> None:
        if self.named is not None:
            log.warning(
                "%s: wrote %s after %.0f s (it was: %s)", self.role, self.what, self.waited(), self.named
            )
            _progress_done(self.what)


# The role's progress (hpcrl.monitor.progress registers itself when a role starts reporting): a
# retried write shows in its stall line. A hook, not an import: the ground floor imports no role code.
_progress: tuple[Callable[[str, str], None], Callable[[str], None]] | None = None


def report_to(waiting: Callable[[str, str], None], done: Callable[[str], None]) -> None:
    """waiting(what, line) when a write of `what` is refused, done(what) once it went through."""
    global _progress
    _progress = (waiting, done)


def _progress_waiting(what: str, on: str) -> None:
    if _progress is not None:
        _progress[0](what, on)


def _progress_done(what: str) -> None:
    if _progress is not None:
        _progress[1](what)


def retry_blocking(
    role: str,
    what: str,
    write: Callable[[], T],
    timeout_s: float,
    *,
    path: Path | str | None = None,
    sleep: Callable[[float], None] = time.sleep,
    **books: Any,
) -> T:
    """`write()` until it goes through (the storage policy, blocking). `path` names the file when the
    error does not (libraries that wrap I/O errors); `books`: Refusals' first_s, cap_s, clock."""
    r = Refusals(role, what, timeout_s, path=path, **books)
    while True:
        wait, out = _attempt(r, write)
        if wait is None:
            return out  # type: ignore[return-value]
        sleep(wait)


async def retry_async(
    role: str,
    what: str,
    write: Callable[[], T],
    timeout_s: float,
    *,
    path: Path | str | None = None,
    **books: Any,
) -> T:
    """retry_blocking for an event loop: the waits do not block it (requests in flight are answered)."""
    import asyncio

    r = Refusals(role, what, timeout_s, path=path, **books)
    while True:
        wait, out = _attempt(r, write)
        if wait is None:
            return out  # type: ignore[return-value]
        await asyncio.sleep(wait)


# How one rank's try went, in retry_together's agreement.
_DONE, _AGAIN, _GAVE_UP, _FAILED = "done", "again", "gave up", "failed"


def retry_together(
    role: str,
    what: str,
    write: Callable[[], T],
    timeout_s: float,
    *,
    gather: Callable[[Any], list[Any]],
    path: Path | str | None = None,
    each_own: bool = False,
    sleep: Callable[[float], None] = time.sleep,
    **books: Any,
) -> T:
    """retry_blocking for a write that every rank of a group makes at once: no rank may try again,
    wait or end alone, or the others hang in the next collective.

    Each rank tries its part, then `gather` (all_gather_object over the ranks) shows every rank how
    each fared and all decide the same: done when every part went through; else all wait the longest
    wait a refused rank asked for (its own books: named once, backoff) and try again; past
    `timeout_s` on any rank, every rank raises that rank's WriteRefused (the same one line). An error
    that is not a refusal ends every rank too (a line naming that rank where it did not happen).
    `each_own`: the parts are rank-local (no collective inside), so a rank whose part went through
    does not write it again; else every rank tries again together (the collectives inside pace the
    write: after a refusal `write` must still take part in every one of them, see its callers).
    With one rank, `gather = lambda x: [x]`: retry_blocking."""
    r = Refusals(role, what, timeout_s, path=path, **books)
    out: Any = None
    mine_done = False
    while True:
        err: BaseException | None = None
        if mine_done:
            mine: tuple[str, float, Any] = (_DONE, 0.0, None)
        else:
            try:
                out, mine = write(), (_DONE, 0.0, None)
            except Exception as e:  # noqa: BLE001 - told to every rank, then raised
                err = e
                try:
                    mine = (_AGAIN, r.refused(e), None)
                except WriteRefused as gone:
                    err, mine = gone, (_GAVE_UP, 0.0, (gone.errno, gone.strerror, gone.filename))
                except Exception:  # noqa: BLE001 - not a refusal
                    mine = (_FAILED, 0.0, f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
        everyone = gather(mine)
        states = [s for s, _, _ in everyone]
        if all(s == _DONE for s in states):
            r.cleared()
            return out  # type: ignore[no-any-return]
        for rank, (s, _, why) in enumerate(everyone):
            if s in (_GAVE_UP, _FAILED):
                if mine[0] == s and mine[2] == why and err is not None:
                    raise err
                if s == _GAVE_UP:
                    raise WriteRefused(*why)
                raise RuntimeError(f"{role}: rank {rank} failed writing {what}: {why}")
        mine_done = each_own and mine[0] == _DONE
        sleep(max(w for _, w, _ in everyone))


def _attempt(r: Refusals, write: Callable[[], T]) -> tuple[float | None, T | None]:
    """One try: (None, what write() returned) or (seconds to wait, None) after a refusal."""
    try:
        out = write()
    except Exception as e:  # noqa: BLE001 - Refusals re-raises what is not a refusal
        return r.refused(e), None
    r.cleared()
    return None, out


_DROPPED: list = [0, None]  # log lines dropped in this process (every tolerant handler), the last why


def dropped_log_lines() -> tuple[int, str | None]:
    """(how many log lines this process's tolerant handlers dropped so far, why the last one was):
    an env server tells the orchestrator (its Pong), whose log the console shows."""
    return _DROPPED[0], _DROPPED[1]


class _Tolerant:
    """A logging handler that the filesystem may refuse: refused lines are dropped (never raised,
    no traceback into the same full file), and the first line that goes through again says how many
    were lost and why. Other errors go to logging's usual handleError."""

    lost = 0
    lost_why: str | None = None

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        import sys

        e = sys.exc_info()[1]
        why = None if e is None else refused_write(e, self._file())
        if why is None:
            super().handleError(record)  # type: ignore[misc]
            return
        self.lost += 1
        self.lost_why = why
        _DROPPED[0] += 1
        _DROPPED[1] = why

    def _file(self) -> str | None:
        """The file this handler writes (a stream's, e.g. stderr sent to a log file: from /proc)."""
        return getattr(self, "baseFilename", None) or _stream_file(self.stream)  # type: ignore[attr-defined]

    def emit(self, record: logging.LogRecord) -> None:
        if self.lost:
            lost, why = self.lost, self.lost_why
            self.lost = 0
            note = logging.LogRecord(
                record.name, logging.WARNING, __file__, 0,
                "%d log line(s) lost: %s", (lost, why), None,
            )  # fmt: skip
            # the handler's filters, as for any record (the role filter sets what the format names)
            if self.filter(note):  # type: ignore[attr-defined]
                super().emit(note)  # type: ignore[misc]
            if self.lost:  # still refused: keep counting
                self.lost += lost
                return
        try:
            super().emit(record)  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - FileHandler opens its file outside its own try
            self.handleError(record)


class TolerantStreamHandler(_Tolerant, logging.StreamHandler):
    pass


class TolerantFileHandler(_Tolerant, logging.FileHandler):
    pass


def _stream_file(stream: Any) -> str | None:
    """The file behind a stream (stderr sent to a log file: from /proc), None when it has no fd."""
    try:
        return os.readlink(f"/proc/self/fd/{stream.fileno()}")
    except (OSError, AttributeError, ValueError):  # no fd (a StringIO), no /proc
        return None


class _TolerantStd:
    """sys.stdout / sys.stderr whose writes the filesystem may refuse: such a write is dropped and
    counted (dropped_log_lines), never raised into the code that wrote it. Other errors (a closed
    pipe: `hpcrl logs | head`) raise as before; everything else is the stream's own."""

    def __init__(self, stream: Any):
        self.hpcrl_raw = stream

    def _dropped(self, e: OSError, lines: int) -> None:
        why = refused_write(e, _stream_file(self.hpcrl_raw))
        if why is None:
            raise e
        _DROPPED[0] += lines
        _DROPPED[1] = why

    def write(self, text: str) -> int:
        try:
            return self.hpcrl_raw.write(text)
        except OSError as e:
            # lines; a progress bar's redraw ("\r…", no newline) is not a line of its own
            self._dropped(e, text.count("\n") or (0 if "\r" in text else 1))
            return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        try:
            self.hpcrl_raw.flush()
        except OSError as e:  # what it holds was counted when its write was refused, or stays held
            self._dropped(e, 0)

    def __getattr__(self, name: str) -> Any:
        if name == "hpcrl_raw":  # not set yet (copy, pickle): not the stream's to answer
            raise AttributeError(name)
        return getattr(self.hpcrl_raw, name)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.hpcrl_raw.__exit__(*exc)


def raw_stream(stream: Any) -> Any:
    """The stream under a tolerate_std_streams wrapper (a logging handler keeps its own books)."""
    return getattr(stream, "hpcrl_raw", stream)


def tolerate_std_streams() -> None:
    """Wrap this process's sys.stdout and sys.stderr (once) so that writes its filesystem refuses
    are dropped and counted instead of raised: every role's entry point calls it first."""
    import sys

    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _TolerantStd):
            setattr(sys, name, _TolerantStd(stream))


def open_log(path: Path, who: str) -> Any:
    """A child process's log, opened for appending (unbuffered). When the filesystem refuses it
    (read-only, full, over quota: a new file cannot be made, an existing one opened for writing), the
    refusal is named once at WARNING with the path and the cause, and the child gets a pipe instead:
    a thread of this process relays its output to the log as soon as the log can be written again
    (tried at most every RELAY_RETRY_S while output comes), with a line saying how many lines were
    lost meanwhile; until then its output is dropped and counted (dropped_log_lines). The child
    starts all the same: a log is never worth a role."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "ab", buffering=0)  # noqa: SIM115 - the caller closes it (or the child's exit)
    except OSError as e:
        why = refused_write(e, path)
        if why is None:
            raise
        log.warning(
            "%s: cannot open its log: %s; its output is relayed once the log can be written", who, why
        )
        _DROPPED[1] = why
        r, w = os.pipe()
        import threading

        threading.Thread(target=_relay, args=(r, path, who, why), name="hpcrl-log-relay", daemon=True).start()
        return open(w, "wb", buffering=0)  # noqa: SIM115 - the caller closes it (the child keeps its copy)


RELAY_RETRY_S = 5.0


def _relay(fd: int, path: Path, who: str, why: str) -> None:
    """Copy a child's output from the pipe `fd` to its log `path` until the child (and every other
    holder of the pipe) is gone; output that arrives while the log cannot be written is dropped and
    counted, then named in the log and here once it can."""
    out, lost, next_try, since, open_line = None, 0, 0.0, time.monotonic(), False
    with open(fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(1 << 16):
            now = time.monotonic()
            if out is None and now >= next_try:
                try:
                    out = open(path, "ab", buffering=0)  # noqa: SIM115 - closed below
                    if lost:
                        clock = time.strftime("%H:%M:%S")
                        out.write(f"{clock} WARNING [{who}] {lost} log line(s) lost: {why}\n".encode())
                    log.warning(
                        "%s: its log can be written again after %.0f s; %d line(s) of its output lost: %s",
                        who, now - since, lost, why,
                    )  # fmt: skip
                except OSError as e:
                    out = _closed(out)
                    why, next_try = refused_write(e, path) or str(e), now + RELAY_RETRY_S
            if out is not None:
                try:
                    out.write(chunk)
                    continue
                except OSError as e:  # refused again: back to dropping, the log tried again later
                    out = _closed(out)
                    why, next_try, since, lost = refused_write(e, path) or str(e), now + RELAY_RETRY_S, now, 0
            # lines, counted at their newline (a line can come in several chunks); an unfinished
            # last line counts once the output ends
            n = chunk.count(b"\n")
            lost, open_line = lost + n, not chunk.endswith(b"\n")
            _DROPPED[0] += n
            _DROPPED[1] = why
    if out is None and open_line:
        _DROPPED[0] += 1
    _closed(out)


def _closed(f: Any) -> None:
    if f is not None:
        with contextlib.suppress(OSError):
            f.close()
    return None
