"""Log records of one component, read backwards from the end by byte offset (a page at a time, so a
10 GB log costs what one page costs), several files merged by time, filtered by text, regex or level,
and followed forward from the offsets the client last saw.

A record is a line that starts with `HH:MM:SS LEVEL` plus the lines after it that do not
(hpcrl.launch.logview's rule), so a traceback stays with its record. Components:

    trainer, orchestrator, inference, launcher   logs/<role>.log + logs/<role>/rank_*.log
    env:NAME                                     logs/envs/{train,eval}/NAME.log + its server and workers
    slurm:FILE                                   logs/slurm/FILE
"""

from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.dashboard.runs import Run
from hpcrl.launch.logview import HEAD, LEVELS, ROLES

CHUNK = 1 << 20  # the most bytes read from one file per round
FIRST_BLOCK = 64 << 10  # the first round's
SCAN_LIMIT = 64 << 20  # bytes scanned per request before answering "more" (a rare search in a huge log)
MAX_RECORD_LINES = 400  # a record longer than this (a huge dump) is cut, saying so


def components(run: Run) -> dict[str, list[Path]]:
    """Every component of a run that has a log file, with its files (only files inside the run)."""
    logs = run.paths.logs_dir
    out: dict[str, list[Path]] = {}
    for role in ROLES:
        files = [run.paths.log_file(role), *sorted((logs / role).glob("rank_*.log"))]
        files = [f for f in files if f.is_file()]
        if files:
            out[role] = files
    envs = sorted(
        {p.stem for p in logs.glob("envs/*/*.log")} | {p.name for p in logs.glob("envs/*/*") if p.is_dir()}
    )
    for name in envs:
        files = []
        for kind in ("train", "eval"):
            files.append(run.paths.env_log_file(kind, name))
            d = run.paths.env_server_dir(kind, name)
            if d.is_dir():
                files += sorted(d.glob("*.log"))
        files = [f for f in files if f.is_file()]
        if files:
            out[f"env:{name}"] = files
    slurm = run.paths.slurm_logs_dir
    for f in sorted(slurm.glob("*")) if slurm.is_dir() else []:
        if f.is_file():
            out[f"slurm:{f.name}"] = [f]
    return {k: v for k, v in ((k, [f for f in fs if run.inside(f)]) for k, fs in out.items()) if v}


@dataclass
class Rec:
    seconds: int  # since midnight; -1 before any head line
    level: int
    text: str
    source: str
    offset: int  # byte offset of the record in its file


HEAD_B = re.compile(HEAD.pattern.encode(), re.MULTILINE)  # logview's head rule, over a whole block
_LEVEL = {k.upper().encode(): v for k, v in LEVELS.items()}


def parse(data: bytes, base: int, source: str, keep: Matcher | None = None) -> list[Rec]:
    """Records of a block of whole lines starting at file offset `base`: the head lines are found
    by one regex scan of the block, and a record is the bytes from its head to the next one. With
    `keep`, only the records that can match are built (a search in a big block builds a few)."""
    heads = list(HEAD_B.finditer(data))
    starts = [m.start() for m in heads]
    ends = [*starts[1:], len(data)]
    out: list[Rec] = []
    if not starts or starts[0] > 0:  # lines before the first head line (a log's preamble)
        end = starts[0] if starts else len(data)
        if data[:end].strip(b"\n") and (keep is None or keep.floor <= 20):
            out.append(_rec(-1, 20, data[:end], source, base))
    chosen = range(len(heads)) if keep is None else keep.candidates(data, starts)
    for i in chosen:
        m = heads[i]
        h, mi, sec, lvl = m.groups()
        level = _LEVEL.get(lvl, 20)
        if keep is not None and level < keep.floor:
            continue
        seconds = int(h) * 3600 + int(mi) * 60 + int(sec)
        out.append(_rec(seconds, level, data[starts[i] : ends[i]], source, base + starts[i]))
    return out


def _rec(seconds: int, level: int, raw: bytes, source: str, offset: int) -> Rec:
    text = raw.rstrip(b"\n").decode(errors="replace")
    if text.count("\n") >= MAX_RECORD_LINES:
        lines = text.split("\n")
        text = "\n".join([*lines[:MAX_RECORD_LINES], f"... ({len(lines) - MAX_RECORD_LINES} more lines)"])
    return Rec(seconds, level, text, source, offset)


def _read_back(path: Path, end: int, size: int = CHUNK) -> tuple[int, bytes]:
    """A block of whole records ending at `end`: it starts at a head line, unless it reaches the
    start of the file (or one record is longer than the block). Returns (start offset, bytes)."""
    start = max(0, end - size)
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    if start > 0:
        nl = data.find(b"\n")
        if nl < 0:
            return end, b""  # no whole line in a chunk: give up on this file (binary garbage)
        m = HEAD_B.search(data, nl + 1)  # start at a head line, so a record is never split
        skip = m.start() if m else nl + 1
        start, data = start + skip, data[skip:]
    return start, data


def _end_of_whole_lines(path: Path) -> int:
    """File size up to the last newline (a line still being written is not shown yet)."""
    try:
        size = os.path.getsize(path)
    except OSError:
        return 0
    if size == 0:
        return 0
    with open(path, "rb") as f:
        back = min(size, 1 << 16)
        f.seek(size - back)
        tail = f.read(back)
    cut = tail.rfind(b"\n")
    return size - back + cut + 1 if cut >= 0 else (0 if back == size else size)


class Matcher:
    """Which records a page shows (level, text or regex, case-insensitive), and `may_match(block)`:
    whether a block of raw bytes can hold one, so a search skips most of a big log unparsed."""

    def __init__(self, q: str | None, regex: bool, level: str | None):
        self.floor = LEVELS.get((level or "").lower(), 0)
        self.pat = self.bpat = None
        self.needle = ""
        if q and regex:
            try:
                self.pat = re.compile(q, re.IGNORECASE)
                self.bpat = re.compile(q.encode(), re.IGNORECASE)
            except re.error as e:
                raise ValueError(f"regex: {e}") from None
        elif q:
            self.needle = q.lower()
        self._bneedle = self.needle.encode()
        self._levels = [k.upper().encode() for k, v in LEVELS.items() if v >= self.floor]

    def __call__(self, r: Rec) -> bool:
        if r.level < self.floor:
            return False
        if self.pat is not None:
            return self.pat.search(r.text) is not None
        return not self.needle or self.needle in r.text.lower()

    def candidates(self, data: bytes, starts: list[int]) -> Any:
        """Indexes of the records (by their start offsets in `data`) that hold a text match: found
        by scanning the raw block, not by building every record."""
        if self.bpat is None and not self._bneedle:
            return range(len(starts))
        if self.bpat is not None:
            hits = (m.start() for m in self.bpat.finditer(data))
        elif self._bneedle.isascii():
            low = data.lower()
            hits = _find_all(low, self._bneedle)
        else:
            return range(len(starts))
        return sorted(
            {max(0, bisect.bisect_right(starts, pos) - 1) for pos in hits} & set(range(len(starts)))
        )

    def may_match(self, data: bytes) -> bool:
        if self.floor >= 30 and not any(lv in data for lv in self._levels):
            return False
        if self.bpat is not None:
            return self.bpat.search(data) is not None
        return not self._bneedle or (self._bneedle in data.lower() if self._bneedle.isascii() else True)


def _find_all(data: bytes, needle: bytes) -> Any:
    i = data.find(needle)
    while i >= 0:
        yield i
        i = data.find(needle, i + 1)


def matcher(q: str | None, regex: bool, level: str | None) -> Matcher:
    return Matcher(q, regex, level)


def _label(run: Run, f: Path) -> str:
    try:
        return f.relative_to(run.paths.logs_dir).as_posix()
    except ValueError:
        return f.name


def page_back(
    run: Run, files: list[Path], cursor: dict[str, int] | None, keep: Matcher, limit: int
) -> dict[str, Any]:
    """The newest `limit` matching records before `cursor` (per file: the offset to read back from;
    none: the files' ends), merged by time: a k-way merge run backwards, each file read a block at a
    time from its end. Returns records oldest first, the cursor of the page before, whether there is
    more, and the files' ends (where `follow` starts)."""
    labels = {_label(run, f): f for f in files}
    ends = {lab: _end_of_whole_lines(f) for lab, f in labels.items()}
    cur = {lab: max(0, min(int((cursor or {}).get(lab, ends[lab])), ends[lab])) for lab in labels}
    readpos = dict(cur)  # where the next block of each file ends
    block = dict.fromkeys(labels, FIRST_BLOCK)  # doubles per read: a page of 300 reads ~64 KiB
    pending: dict[str, list[Rec]] = {lab: [] for lab in labels}  # read, not placed (file order)
    out: list[Rec] = []
    scanned = 0
    while len(out) < limit:
        for lab, f in labels.items():
            while not pending[lab] and readpos[lab] > 0 and scanned < SCAN_LIMIT:
                start, data = _read_back(f, readpos[lab], block[lab])
                block[lab] = min(CHUNK, 2 * block[lab])
                if not data:
                    readpos[lab] = 0
                    break
                scanned += len(data)
                readpos[lab] = start
                if not keep.may_match(data):  # nothing to show in it: its records count as placed
                    cur[lab] = start
                    continue
                pending[lab] = parse(data.rstrip(b"\n"), start, lab, keep)
        if any(not pending[k] and readpos[k] > 0 for k in labels):
            break  # scan budget spent: a file's older text is unread, the merge cannot go on
        live = [lab for lab in labels if pending[lab]]
        if not live:
            break
        lab = max(live, key=lambda k: pending[k][-1].seconds)  # the newest unplaced record
        r = pending[lab].pop()
        cur[lab] = r.offset  # everything of this file from here on has been placed
        if keep(r):
            out.append(r)
    out.reverse()
    return {
        "records": [_json(r, len(labels) > 1) for r in out],
        "cursor": cur,
        "more": any(p > 0 for p in cur.values()),
        "after": ends,
        "scanned_bytes": scanned,
    }


def follow(run: Run, files: list[Path], after: dict[str, int], keep: Matcher, limit: int) -> dict[str, Any]:
    """Records appended after the offsets `after` (the previous answer's `after`), oldest first."""
    out: list[Rec] = []
    ends: dict[str, int] = {}
    for f in files:
        lab = _label(run, f)
        end = _end_of_whole_lines(f)
        start = int(after.get(lab, end))
        if start > end:  # the file was replaced (a new run): start over
            start = 0
        if end > start:
            start = max(start, end - SCAN_LIMIT)
            with open(f, "rb") as fh:
                fh.seek(start)
                data = fh.read(end - start)
            out += [r for r in parse(data.rstrip(b"\n"), start, lab, keep) if keep(r)]
        ends[lab] = end
    out.sort(key=lambda r: r.seconds)
    return {"records": [_json(r, len(files) > 1) for r in out[-limit:]], "after": ends}


def _json(r: Rec, many: bool) -> dict[str, Any]:
    lvl = {10: "DEBUG", 20: "INFO", 30: "WARNING", 40: "ERROR", 50: "CRITICAL"}.get(r.level, "INFO")
    return {"t": r.seconds, "level": lvl, "source": r.source if many else "", "text": r.text}


def recent_problems(run: Run, per_file_bytes: int = 256 << 10, limit: int = 12) -> list[dict[str, Any]]:
    """The newest WARNING and ERROR records of the roles' logs, one per distinct message with its
    count (numbers in a message do not make it distinct: "no progress for 31 s" and "... 41 s").
    Cached per log file by (size, mtime): a page polled every few seconds rereads only a log that grew."""
    keep = matcher(None, False, "warning")
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    cache = run.cache.setdefault("problems", {})
    for role in ROLES:
        f = run.paths.log_file(role)
        if not f.is_file() or not run.inside(f):
            continue
        st = f.stat()
        hit = cache.get(role)
        if hit is None or hit[0] != (st.st_size, st.st_mtime_ns):
            cache[role] = hit = ((st.st_size, st.st_mtime_ns), _problems_of(f, role, per_file_bytes, keep))
        for key, g in hit[1].items():
            groups[key] = dict(g)
    rows = sorted(groups.values(), key=lambda g: -g["t"])[:limit]
    for g in rows:
        g["level"] = "ERROR" if g["level"] >= 40 else "WARNING"
    return rows


def _problems_of(f: Path, role: str, nbytes: int, keep: Any) -> dict[tuple[str, str], dict[str, Any]]:
    end = _end_of_whole_lines(f)
    start, data = _read_back(f, end, nbytes) if end else (0, b"")
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for r in parse(data.rstrip(b"\n"), start, role):
        if not keep(r):
            continue
        first = r.text.split("\n", 1)[0]
        body = HEAD.sub("", first).strip()
        key = (role, re.sub(r"\d+(\.\d+)?", "N", body))
        g = groups.get(key)
        if g is None:
            groups[key] = {"role": role, "text": first, "count": 1, "t": r.seconds, "level": r.level}
        else:
            g.update(text=first, t=r.seconds, count=g["count"] + 1)
    return groups
