"""Log records: a line that starts with `HH:MM:SS LEVEL` (hpcrl's format, every role and env process)
plus the lines after it that do not. Below both readers of logs: `hpcrl logs` (logview) and the
console's warning lines (alerts)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

HEAD = re.compile(r"^(\d\d):(\d\d):(\d\d)(?:[.,]\d+)? +(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b")
LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
ROLES = ("trainer", "orchestrator", "inference", "launcher")


@dataclass
class Record:
    seconds: float  # seconds since midnight of the record's time (-1: before any head line)
    level: int
    lines: list[str]
    source: str = ""


def records(lines: Iterable[str], source: str = "") -> Iterator[Record]:
    cur: Record | None = None
    for line in lines:
        m = HEAD.match(line)
        if m:
            if cur is not None:
                yield cur
            h, mi, s, lvl = m.groups()
            cur = Record(int(h) * 3600 + int(mi) * 60 + int(s), LEVELS[lvl.lower()], [line], source)
        elif cur is None:
            cur = Record(-1, 20, [line], source)
        else:
            cur.lines.append(line)
    if cur is not None:
        yield cur


# hpcrl.monitor.logging's format; a role may hold brackets itself (`[sft[0]]`)
_ERROR_LINE = re.compile(r" ERROR +(?:\[(?:[^\[\]]|\[[^\]]*\])*\] )?(.*)")


def last_error(log_path: Path, tail: int = 65536, since: int = 0) -> str:
    """The role's last ERROR log line (its one-line reason), without the timestamp prefix; "" if none.
    Only lines past byte `since` count: those before were written by an earlier process (a resumed
    run appends to the same log), and a process killed by a signal writes no ERROR line at all."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(since, f.seek(0, os.SEEK_END) - tail))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        m = _ERROR_LINE.search(line)
        if m:
            return m.group(1).strip()[:500]
    return ""
