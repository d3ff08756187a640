"""The roles' WARNING and ERROR lines on the console (issue 51): `hpcrl run` prints them as they
happen, between its step lines; `hpcrl logs DIR --warnings` prints the same for any run (a SLURM
job's too: its roles log into the same files).

Each distinct message is printed once, with a count: the first time it is seen, and again at the
10th, 100th, 1000th ... time (`(x10)`), as hpcrl.orchestrator.causes counts errored rollouts. Two
messages are the same when they differ only in numbers (pids, ports, seconds, steps): "no progress
for 6 s" and "no progress for 7 s" are one. A record's traceback lines are not printed (`hpcrl logs`
shows them).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hpcrl.launch.logrecords import LEVELS, ROLES, Record, records
from hpcrl.paths import RunPaths

_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_HEAD = re.compile(r"^(\S+) +(WARNING|ERROR|CRITICAL) +(?:\[([^\]]*)\] )?(.*)$")
WIDTH = 300  # characters of a printed message (stall lines name stacks files and more)
# Each errored rollout's own line (an env's log, propagated to the orchestrator's): its cause is
# named, counted at 1, 10, 100 ... and judged systematic by hpcrl.orchestrator.causes, whose lines
# are printed instead.
_PER_ROLLOUT = re.compile(r"^rollout \d+ errored: ")
# A stall and its recovery (hpcrl.monitor.progress) are a pair: a recovery is printed whenever the
# role's latest stall line was, however often the same recovery text came before (a slow first step
# at start-up, then a frozen server, are two stalls with one recovery text).
_STALL = re.compile(r": no progress for \d")
_RECOVERY = re.compile(r": moving again ")
# So are a write the filesystem refused and the write going through (hpcrl.storage): each time a
# role's storage is refused again after it cleared (a disk full twice in a run), its line is printed,
# with its own figures, however often the same text came before.
_REFUSED = re.compile(r": cannot write .+; retrying in ")
_WROTE = re.compile(r": wrote .+ after \d+ s \(it was: ")
# A line naming a process (`(pid 123) died`) that names one not seen in it before is a new event (a
# replacement killed in turn): printed with its own figures, at most once per PID_GAP_S per message.
_PID = re.compile(r"\bpid (\d+)")
PID_GAP_S = 10


def role_logs(paths: RunPaths) -> list[Path]:
    """Every role's log: logs/<role>.log and logs/<role>/rank_R.log (ranks, servers)."""
    out: list[Path] = []
    for role in ROLES:
        out.append(paths.log_file(role))
        out += sorted((paths.logs_dir / role).glob("rank_*.log"))
    return out


def key_of(message: str) -> str:
    """What makes two messages the same one: the text with its numbers masked."""
    return _NUMBER.sub("#", message)


@dataclass
class Seen:
    line: str  # the first occurrence, as printed
    count: int = 0
    last: str = ""  # the clock time of the newest occurrence
    newest: str = ""  # the newest occurrence, with its own figures
    order: int = 0  # when the newest occurrence came, among all messages
    pids: set[str] = field(default_factory=set)  # the processes its occurrences named
    printed: float = -1e9  # seconds since midnight of its last printed line


def _next_mark(n: int) -> bool:
    """Print again at 10, 100, 1000, ...: a count that is a power of ten."""
    return n >= 10 and str(n).strip("0") == "1"


@dataclass
class Alerts:
    """Distinct WARNING/ERROR messages and their counts (pure: fed records, returns lines)."""

    seen: dict[str, Seen] = field(default_factory=dict)
    stall_shown: dict[str, bool] = field(default_factory=dict)  # role -> its latest stall was printed
    refused: set[str] = field(default_factory=set)  # roles with a refused write not yet cleared
    n: int = 0  # occurrences seen, all messages

    def see(self, rec: Record) -> str | None:
        """The line to print now for `rec` (None: not a warning, or a repeat not due)."""
        key_line = self._see(rec)
        if key_line is None:
            return None
        s, line = key_line
        if line is not None:
            s.printed = rec.seconds
        return line

    def _see(self, rec: Record) -> tuple[Seen, str | None] | None:
        if rec.level < LEVELS["warning"]:
            return None
        m = _HEAD.match(rec.lines[0])
        if m is None:
            return None
        clock, level, role, message = m.groups()
        if _PER_ROLLOUT.match(message):
            return None
        key = f"{role}|{key_of(message)}"
        s = self.seen.get(key)
        if s is None:
            s = self.seen[key] = Seen(f"{clock} {level} [{role or '?'}] {_cut(message)}")
        self.n += 1
        who = role or "?"
        own = f"{clock} {level} [{who}] {_cut(message)}"  # this one, with its own figures
        s.count, s.last, s.newest, s.order = s.count + 1, clock, own, self.n
        pids = set(_PID.findall(message))
        new_process = bool(pids - s.pids) and s.count > 1 and (rec.seconds - s.printed) % 86400 >= PID_GAP_S
        s.pids |= pids
        line = s.line if s.count == 1 else f"{s.line} (x{s.count})"
        due = s.count == 1 or _next_mark(s.count)
        if _STALL.search(message):
            self.stall_shown[who] = due or new_process
        elif _RECOVERY.search(message) and self.stall_shown.pop(who, False) and not due:
            return s, own
        elif _REFUSED.search(message) and who not in self.refused:  # refused again after it cleared
            self.refused.add(who)
            return s, line if due else own
        elif _WROTE.search(message) and who in self.refused:
            self.refused.discard(who)
            return s, line if due else own
        return s, line if due else own if new_process else None

    def recent(self, limit: int) -> list[str]:
        """The `limit` messages seen last, oldest first, each as its newest occurrence with its count
        and first time (`hpcrl status`)."""
        newest = sorted(self.seen.values(), key=lambda s: s.order)[-limit:] if limit > 0 else []
        return [
            s.newest if s.count == 1 else f"{s.newest} (x{s.count} since {s.line.split(' ', 1)[0]})"
            for s in newest
        ]

    def summary(self) -> list[str]:
        """Every distinct message once, in order of first occurrence, with its count and last time."""
        return [
            s.line if s.count == 1 else f"{s.line} (x{s.count}, last {s.last})" for s in self.seen.values()
        ]


def _cut(text: str) -> str:
    return text if len(text) <= WIDTH else text[: WIDTH - 1] + "…"


class LogTail:
    """New complete records of a set of log files (re-listed each poll: rank logs appear late)."""

    def __init__(self, files: Callable[[], list[Path]], from_end: bool = True):
        self.files = files
        self.offsets: dict[Path, int] = {}
        if from_end:  # what earlier sessions wrote (a resumed run appends to the same logs) is old news
            for p in files():
                self.offsets[p] = _size(p)

    def poll(self) -> list[Record]:
        out: list[Record] = []
        for p in self.files():
            size = _size(p)
            start = self.offsets.get(p, 0)
            if size < start:  # truncated or replaced: read it from its start
                start = 0
            if size == start:
                self.offsets[p] = size
                continue
            with open(p, "rb") as f:
                f.seek(start)
                chunk = f.read(size - start)
            cut = chunk.rfind(b"\n") + 1  # a half-written last line waits for the next poll
            self.offsets[p] = start + cut
            out += records(chunk[:cut].decode(errors="replace").splitlines(), p.name)
        out.sort(key=lambda r: r.seconds)  # stable: one file's records keep their order
        return out


def _size(p: Path) -> int:
    try:
        return os.stat(p).st_size
    except OSError:
        return 0


class ConsoleAlerts:
    """What `hpcrl run`'s console prints between its step lines: new WARNING/ERROR lines of every role."""

    def __init__(self, paths: RunPaths):
        self.tail = LogTail(lambda: role_logs(paths))
        self.alerts = Alerts()

    def poll(self) -> list[str]:
        return [line for rec in self.tail.poll() if (line := self.alerts.see(rec)) is not None]


def distinct(recs: Iterable[Record]) -> list[str]:
    """`hpcrl logs --warnings` without -f: each distinct message once, with its count."""
    a = Alerts()
    for r in recs:
        a.see(r)
    return a.summary()


def recent_warnings(
    paths: RunPaths,
    window_s: float | None,
    limit: int = 6,
    tail_bytes: int = 256 << 10,
    now: float | None = None,
) -> list[str]:
    """`hpcrl status`'s recent warnings: the distinct WARNING/ERROR messages of every role's log
    (the last `tail_bytes` of each) within `window_s` of now (None: any age, for a run that ended),
    the `limit` newest, oldest first. A process replaced, a server marked down, a write refused: named
    here for as long as the window, where the progress rows show only what holds now."""
    import time

    now = time.time() if now is None else now
    clock = now - time.mktime(time.localtime(now)[:3] + (0, 0, 0, 0, 0, -1))  # the logs' clock: local
    recs: list[Record] = []
    for p in role_logs(paths):
        try:
            if window_s is not None and os.stat(p).st_mtime < now - window_s:
                continue
            with open(p, "rb") as f:
                start = max(0, f.seek(0, os.SEEK_END) - tail_bytes)
                f.seek(start)
                data = f.read()
        except OSError:
            continue
        if start:
            data = data[data.find(b"\n") + 1 :]  # its first line began before the tail
        recs += (
            r
            for r in records(data.decode(errors="replace").splitlines(), p.name)
            if r.seconds >= 0 and (window_s is None or (clock - r.seconds) % 86400 <= window_s)
        )
    alerts = Alerts()
    for r in sorted(recs, key=lambda r: (clock - r.seconds) % 86400, reverse=True):  # oldest first
        alerts.see(r)
    return alerts.recent(limit)


def show_warnings(paths: RunPaths, follow: bool, keep: Callable[[Record], bool] = lambda r: True) -> int:
    """`hpcrl logs DIR --warnings [-f]`: every role's distinct WARNING/ERROR messages with their
    counts; -f then prints new ones as they happen (as `hpcrl run` does)."""
    import time

    tail, alerts = LogTail(lambda: role_logs(paths), from_end=False), Alerts()
    for rec in tail.poll():
        if keep(rec):
            alerts.see(rec)
    lines = alerts.summary()
    print("\n".join(lines) if lines else f"no WARNING or ERROR lines in {paths.logs_dir} yet", flush=True)
    while follow:
        time.sleep(0.5)
        for rec in tail.poll():
            if keep(rec) and (line := alerts.see(rec)) is not None:
                print(line, flush=True)
    return 0
