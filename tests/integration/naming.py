"""Where the fault matrix looks for a fault's name besides the role's log (issue 52: "the component is
named on the console and in `hpcrl status` within the bound"): the console of `hpcrl run` / `hpcrl
sft` (its stdout and stderr, read line by line as it prints them) and `hpcrl status <run dir>`
(hpcrl.launch.manage.status called in this process: the same text, without a Python started per
poll).

    console = Console(proc.stdout, proc.stderr)
    seen = Named(console, run_dir, "orchestrator", console=[...], status=[...])  # timed from now
    _until(seen.poll, bound, "...")    # seen.console_s, seen.status_s, seen.console_line ...
"""

from __future__ import annotations

import contextlib
import io
import re
import threading
import time
from pathlib import Path
from typing import IO, Any


class Console:
    """Every line a launcher prints, with the monotonic time it arrived (a thread per stream: the
    pipes never fill, however long the run)."""

    def __init__(self, *streams: IO[str] | None):
        self.lines: list[tuple[float, int, str]] = []  # (time, stream index, line)
        self.threads = [
            threading.Thread(target=self._read, args=(i, s), daemon=True) for i, s in enumerate(streams) if s
        ]
        for t in self.threads:
            t.start()

    def _read(self, i: int, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append((time.monotonic(), i, line))

    def join(self, timeout: float = 30) -> None:
        for t in self.threads:
            t.join(timeout)

    def text(self, i: int) -> str:
        return "".join(line for _, j, line in list(self.lines) if j == i)

    def since(self, t0: float) -> list[tuple[float, str]]:
        return [(t, line.rstrip("\n")) for t, _, line in list(self.lines) if t >= t0]


def status_text(root: Path) -> str:
    """What `hpcrl status <root>` prints now ("" before the run directory is prepared)."""
    from hpcrl.launch.manage import status

    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            status([str(root)])
    except SystemExit:
        return ""
    return out.getvalue()


def status_line(text: str, role: str | tuple[str, ...], names: list[str]) -> str | None:
    """The line of `hpcrl status` under `role`'s progress row (a role, or any of several) that holds
    every one of `names`."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if i and all(n in line for n in names) and lines[i - 1].strip().startswith(role):
            return line.strip()
    return None


class Named:
    """From its creation (t0): when the console first printed a WARNING line holding every one of
    `console`, and when `hpcrl status` first showed, under `role`, a line holding every one of
    `status` (polled every `every` s: it reads the run's metrics and checkpoints)."""

    def __init__(
        self,
        console: Console,
        root: Path,
        role: str | tuple[str, ...],
        *,
        console_names: list[str],
        status_names: list[str],
        every: float = 0.4,
    ):
        self.out, self.root, self.role = console, root, role
        self.console_names, self.status_names, self.every = console_names, status_names, every
        self.t0 = time.monotonic()
        self.console_s: float | None = None
        self.status_s: float | None = None
        self.console_line = self.status_line = ""
        self._next = 0.0

    def poll(self) -> bool:
        """True once both named it."""
        if self.console_s is None:
            for t, line in self.out.since(self.t0):
                if "WARNING" in line and all(n in line for n in self.console_names):
                    self.console_s, self.console_line = t - self.t0, line
                    break
        now = time.monotonic()
        if self.status_s is None and now >= self._next:
            self._next = now + self.every
            line = status_line(status_text(self.root), self.role, self.status_names)
            if line is not None:
                self.status_s, self.status_line = time.monotonic() - self.t0, line
        return self.console_s is not None and self.status_s is not None

    def missing(self) -> str:
        what = [
            f"the console naming {self.console_names}" if self.console_s is None else "",
            f"`hpcrl status` naming {self.status_names} under {self.role}" if self.status_s is None else "",
        ]
        return " and ".join(w for w in what if w) or "nothing"

    def cells(self) -> dict:
        """The table's two columns."""
        return {
            "console_s": None if self.console_s is None else round(self.console_s, 1),
            "status_s": None if self.status_s is None else round(self.status_s, 1),
        }


def names_for(names: list[str]) -> tuple[list[str], list[str]]:
    """(console, status) names from a log line's `names` (a `cannot write X` line with its cause and
    path): the console prints the line itself, cut at 300 characters (so not its free-space tail);
    `hpcrl status` says `waiting on writing X: <cause> at <path> (...), ERRNO for N s`."""
    console = ["cannot write", *(n for n in names if n != "free of")]
    status = ["waiting on writing"] + [
        n.replace("cannot write ", "writing ") for n in names if n != "free of"
    ]
    return console, status


# alternatives: a line names it when it holds every string of one of them (or a test on the line)
Pred = list[list]


_LOGGED = re.compile(r"^(\d\d):(\d\d):(\d\d) (?:WARNING|ERROR|CRITICAL) ")


def logged_before(line: str, t0_wall: float) -> bool:
    """A line of `hpcrl status`'s recent warnings logged before the fault (its leading clock, local,
    a second or more before t0): it names an earlier fault, not this one."""
    m = _LOGGED.match(line)
    if m is None:
        return False
    at = int(m[1]) * 3600 + int(m[2]) * 60 + int(m[3])
    t = time.localtime(t0_wall)
    ago = (t.tm_hour * 3600 + t.tm_min * 60 + t.tm_sec - at) % 86400
    return 0 < ago < 43200


def holds(line: str, alternatives: Pred) -> bool:
    return any(all(s(line) if callable(s) else s in line for s in alt) for alt in alternatives)


class Watch:
    """Named, for the rows that are not a refused write: from its creation (t0), when the console
    first printed a WARNING/ERROR line (or the launcher's own `hpcrl:` line) matching `console`, and
    when a line of `hpcrl status` first matched `status` (any line: a progress row, its stall or
    server line, an errored-rollout cause, the env servers' table, the run's `ended:` line), each
    one of several alternatives (`Pred`). `poll()` during the fault's own window; `quiet()` after a
    fault under the bound: nothing may have named it."""

    def __init__(self, out: Console | None, root: Path, console: Pred, status: Pred, every: float = 0.4):
        self.out, self.root, self.cpred, self.spred, self.every = out, root, console, status, every
        self.t0 = time.monotonic()
        self.t0_wall = time.time()
        self.console_s: float | None = None
        self.status_s: float | None = None
        self.console_line = self.status_line = ""
        self._next = 0.0
        self.under: float | None = None  # quiet(): a progress row stale for less than this is no naming

    def tolerated(self, line: str) -> bool:
        """Under the bound, a row `unresponsive … reported N s ago` with N under it: between two of its
        progress writes (every 2 s, stale after 5 s) a process frozen 3 s reads so for a moment; it is
        not named as stalled, nor for longer than the bound."""
        m = re.search(r"unresponsive .*reported (\d+) s ago", line)
        return self.under is not None and m is not None and int(m.group(1)) < self.under

    def poll(self) -> bool:
        """True once both named it (`hpcrl status` alone where there is no console: out None)."""
        if self.console_s is None and self.out is not None:
            for t, line in self.out.since(self.t0):
                loud = any(w in line for w in ("WARNING", "ERROR", "hpcrl: "))
                if loud and holds(line, self.cpred):
                    self.console_s, self.console_line = t - self.t0, line
                    break
        now = time.monotonic()
        if self.status_s is None and now >= self._next:
            self._next = now + self.every
            lines = (x.strip() for x in status_text(self.root).splitlines() if holds(x, self.spred))
            line = next(
                (x for x in lines if not self.tolerated(x) and not logged_before(x, self.t0_wall)), None
            )
            if line is not None:
                self.status_s, self.status_line = time.monotonic() - self.t0, line
        return (self.console_s is not None or self.out is None) and self.status_s is not None

    def named(self, within: float) -> None:
        """Assert both named it within `within` s of t0 (poll() first)."""
        self.poll()
        late = [
            f"console {self.cpred} ({self.console_s})" if (self.console_s or 1e9) > within else "",
            f"status {self.spred} ({self.status_s})" if (self.status_s or 1e9) > within else "",
        ]
        assert not any(late), f"not named within {within} s: {' '.join(late)}"

    def quiet(self) -> None:
        """Assert neither named it (a fault under the bound is not a stall)."""
        self.poll()
        assert self.console_s is None, f"named on the console: {self.console_line}"
        assert self.status_s is None, f"named by `hpcrl status`: {self.status_line}"

    def cells(self) -> dict:
        return {
            k: None if v is None else round(v, 1)
            for k, v in (("console_s", self.console_s), ("status_s", self.status_s))
        }


UNDER = "- (under the bound: must not be named)"  # the cell of a freeze under the bound (asserted)


def stall_names(role: str, pid: int) -> tuple[Pred, Pred]:
    """(console, status) that name a frozen `role` of the fault matrix (`hpcrl status`: its progress
    row unresponsive, or the stall line of the role waiting on it, or the server's state)."""
    stall, inf = "no progress for", "inference server 0"
    return {
        "inference": (
            [
                [stall, inf],
                [inf, "does not answer /health"],
                [inf, "server_down_timeout_s"],
                [inf, "is down"],
            ],
            [[stall, inf], [inf, "unresponsive"], [inf, ": down"]],
        ),
        "trainer": ([[stall, "trainer_0 unresponsive"]], [["trainer_0", "unresponsive"]]),
        "orchestrator": ([[stall, "orchestrator unresponsive"]], [["orchestrator", "unresponsive"]]),
        "env-worker": (
            [[stall, f"(pid {pid})"], [f"(pid {pid}) frozen"]],
            [[f"(pid {pid})", "in env code"], [f"(pid {pid}) frozen"]],
        ),
        "env-server": ([[f"(pid {pid}) answered no ping"]], [[f"(pid {pid}) answered no ping"]]),
    }[role]


def ended_watch(run: Any, said: str) -> Watch:
    """A role killed, ending the run: the launcher's last line on the console and `hpcrl status`'s
    `ended:` line (hpcrl.launch.local.ended) name it, timed from now."""
    seen = Watch(run.console, run.paths.root, [[said]], [["ended:", said]])
    end = time.monotonic() + 120
    while not seen.poll():
        assert time.monotonic() < end, f"not named within 120 s: {seen.missing()}"
        time.sleep(0.2)
    return seen


def ended_cells(took: float, status: str, none: str) -> dict:
    """A run that ended by itself (subprocess.run): its last line is the console's, at `took`; the
    status read once it ended (`ended:` line) named it by then."""
    return {
        "console_s": f"≤ {took:.1f} (its last line)",
        "status_s": f"≤ {took:.1f} (its `ended:` line)" if "ended:" in status else f"- ({none})",
    }


# The cells of rows with no launcher: the test's own processes (two gloo ranks) or its own process
# (a LoRA adapter's publisher / checkpointer). The same hpcrl.storage line and `waiting on writing`
# report are timed on the console and in `hpcrl status` by the RL and SFT storage rows.
RANKS_CELLS = (
    "- (no launcher: 2 ranks of the test's gloo group (ranks.py); the line is in each rank's log)",
    "- (no launcher, no run to show: the ranks are the test's workers)",
)
IN_PROCESS_CELLS = (
    "- (in-process: no launcher console; its line asserted in the log records)",
    "- (in-process: no run started, no progress report)",
)
