"""The fault matrix's tools (tests/integration/test_fault_matrix.py): a run under test, waits, the
faults that need more than a signal (a full disk, an unwritable directory), and the table."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpcrl import checkpoint
from hpcrl.paths import RunPaths
from tests.integration.naming import Console, Named, ended_watch, names_for

ROWS: list[dict] = []  # the table: one row per case (the matrix and the fault tests beside it)
RETRIED = "retried with backoff; written once it cleared, run goes on"
EXTRA_ENV: dict[str, str] = {}  # for every process a test starts here (the quota's LD_PRELOAD: quota.py)


def _hpcrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcrl.cli", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", **EXTRA_ENV}


@dataclass
class Run:
    proc: subprocess.Popen
    paths: RunPaths
    console: Console = field(init=False)  # its stdout and stderr as it prints them (naming.py)

    def __post_init__(self) -> None:
        self.console = Console(self.proc.stdout, self.proc.stderr)

    def steps(self) -> int:
        p = self.paths.prompts_log
        return len(p.read_text().splitlines()) if p.exists() else 0

    def pid(self, role: str) -> int:
        if role.startswith("env-"):  # env-server / env-worker of the train env (hpcrl components)
            doc = json.loads(
                (self.paths.env_server_dir("train", "reverse-text") / "components.json").read_text()
            )
            return doc["server"]["pid"] if role == "env-server" else doc["workers"][0]["pid"]
        return json.loads(self.paths.placement_file(role, 0).read_text())["pid"]

    def log(self, role: str) -> str:
        p = self.paths.log_file(role)
        return p.read_text(errors="replace") if p.exists() else ""

    def wait_steps(self, n: int, timeout: float = 120) -> None:
        target = self.steps() + n
        _until(lambda: self.steps() >= target or self.proc.poll() is not None, timeout, f"{n} more steps")
        assert self.proc.poll() is None, self.output()

    def communicate(self, timeout: float) -> tuple[str, str]:
        """Popen.communicate for a run whose console is read as it prints: (stdout, stderr)."""
        self.proc.wait(timeout)
        self.console.join()
        return self.console.text(0), self.console.text(1)

    def output(self) -> str:
        if self.proc.poll() is None:
            return ""
        out, err = self.communicate(60)
        return out[-3000:] + err[-3000:]


def _until(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out ({timeout:.0f} s) waiting for {what}"
        time.sleep(0.1)
    return time.monotonic() - t0


def _start(root: Path, *args: str) -> Run:
    proc = subprocess.Popen(
        _hpcrl(*args), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    return Run(proc, RunPaths(root))


def _status(out: Path) -> str:
    return subprocess.run(
        _hpcrl("status", str(out)), env=_env(), capture_output=True, text=True, timeout=60
    ).stdout


def _new_lines(text: str, since: int) -> str:
    return text[since:]


def _mount_tmpfs(d: Path, size: str) -> str | None:
    """A small tmpfs at `d` (the disk that fills up); None, or why it cannot be mounted here."""
    d.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True, text=True
    )
    return None if res.returncode == 0 else f"mount -t tmpfs refused: {(res.stderr or res.stdout).strip()}"


class Filler:
    """Keeps the filesystem of `d` full (write(2) says ENOSPC) until stop(): a thread tops the
    filler file up, since a reader deleting old files (the trainer's bus cleanup) frees space."""

    def __init__(self, d: Path):
        self.path, self.done = d / "filler", threading.Event()
        self.f = open(self.path, "wb", buffering=0)  # noqa: SIM115 - closed by stop()
        self._top_up()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _top_up(self) -> None:
        for size in (1 << 20, 4096):
            try:
                while True:
                    self.f.write(b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC, e

    def _run(self) -> None:
        while not self.done.wait(0.05):
            self._top_up()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        self.f.close()
        self.path.unlink()


def _remount(d: Path, mode: str) -> None:
    """`mount -o remount,ro|rw` of the tmpfs at `d`: read-only is a real EROFS for every write under
    it (the issue's `read-only filesystem at .../broadcasts/step_14`). A write in flight makes the
    kernel refuse `ro` (EBUSY) for a moment: tried again."""
    for _ in range(100):
        res = subprocess.run(["mount", "-o", f"remount,{mode}", str(d)], capture_output=True, text=True)
        if res.returncode == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"remount,{mode} {d}: {(res.stderr or res.stdout).strip()}")


def refused(
    run: Run, role: str | tuple[str, ...], row: dict, make, undo, names: list[str], hold: float, within: float
) -> None:
    """Make `role`'s writes fail (make()) until its log names the refusal (a `cannot write` line with
    all of `names`), the console of the run prints it and `hpcrl status` shows the role waiting on
    that write, each within `within` s timed from make(), and `hold` s have passed; then undo(): the
    write must go through (`wrote ... after`) and the run go on. Appends `row` with what was said
    and when each named it. With several roles, the first to meet the fault is the one asserted (a
    checkpoint's parts: whichever of the trainer and the orchestrator writes first is refused, and
    the other then waits on it)."""
    roles = (role,) if isinstance(role, str) else role
    marks = {r: len(run.log(r)) for r in roles}
    make()
    console, status = names_for(names)
    seen = Named(run.console, run.paths.root, roles, console_names=console, status_names=status)
    t0 = seen.t0
    try:
        log: list[tuple[float, str, str]] = []

        def named() -> tuple[str, str] | None:
            for r in roles:
                new = _new_lines(run.log(r), marks[r]).splitlines()
                hit = next((x for x in new if "cannot write" in x and all(n in x for n in names)), None)
                if hit is not None:
                    return r, hit
            return None

        def everywhere() -> bool:
            if not log and (hit := named()) is not None:
                log.append((time.monotonic() - t0, *hit))
            return seen.poll() and bool(log)

        try:
            _until(everywhere, within, f"the {' or '.join(roles)} naming {row['fault']}")
        except AssertionError as e:  # say what was missing and what the roles did instead
            raise AssertionError(
                f"{e}: missing {seen.missing()}{'' if log else ' and its log line'}"
                + "".join(f"\n--- {r} log since:\n{_new_lines(run.log(r), marks[r])[-4000:]}" for r in roles)
                + "\n--- console since:\n"
                + "\n".join(line for _, line in run.console.since(t0))[-3000:]
            ) from None
        took, who, line = log[0]
        time.sleep(max(0.0, hold - (time.monotonic() - t0)))
    finally:
        undo()
    _until(lambda: f"{who}: wrote " in run.log(who)[marks[who] :], 90, "the write going through")
    run.wait_steps(2)
    component = row["component"] if len(roles) == 1 else row["component"].format(role=who)
    ROWS.append(
        {
            **row,
            "component": component,
            "named_s": round(took, 1),
            "named_by": who,
            "line": _short(line.split("] ", 1)[-1])[:240],
            **seen.cells(),
        }
    )


def _make_unwritable(d: Path) -> tuple[str, list[str]]:
    """(how, the command that undoes it). As root chmod does not stop a write: `chattr +i` (the
    directory immutable: no entry can be created in it, whoever asks) does; as a user, chmod 0555."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(d)], check=True)
        return "chattr +i", ["chattr", "-i", str(d)]
    d.chmod(0o555)
    return "chmod 0555", ["chmod", "0755", str(d)]


def _not_run(component: str, fault: str, why: str) -> dict:
    return {
        "component": component,
        "fault": fault,
        "named_s": None,
        "named_by": "-",
        "line": why,
        "outcome": "not run here",
        "data": "- (not run)",
        "console_s": "- (not run)",
        "status_s": "- (not run)",
    }


_TMP = re.compile(r"/tmp/pytest-of-[^/]+/pytest-\d+/[^/\s]+/")


def _short(text: str) -> str:
    """`…/run/x` for a test's own directory (/tmp/pytest-of-root/pytest-N/<test>/run/x) in the table."""
    return _TMP.sub("…/", text)


def row(
    component: str,
    fault: str,
    named_s,
    named_by: str,
    line: str,
    outcome: str,
    data: str,
    console_s: float | str | None = None,
    status_s: float | str | None = None,
) -> None:
    """A row of the table from a test beside the shared run (SFT, several ranks, a LoRA adapter);
    `console_s` / `status_s`: when the console and `hpcrl status` named it (None: not checked)."""
    ROWS.append(
        {
            "component": component,
            "fault": fault,
            "named_s": None if named_s is None else round(named_s, 1),
            "named_by": named_by,
            "line": _short(line),
            "outcome": outcome,
            "data": data,
            **{
                k: round(v, 1) if isinstance(v, float) else v
                for k, v in (("console_s", console_s), ("status_s", status_s))
                if v is not None
            },
        }
    )
    _write_table()


NOT_CHECKED = "not checked"  # a row whose console and `hpcrl status` the matrix does not time (yet)


def _seconds(r: dict, key: str) -> str:
    v = r.get(key, NOT_CHECKED)
    return "-" if v is None else str(v)


def _write_table() -> None:
    target = os.environ.get("HPCRL_FAULT_TABLE")
    if not target:
        return
    head = (
        "| component | fault | named after (s) | named by | console after (s) | status after (s) | "
        "what it said | outcome | data check |\n"
        "|---|---|---|---|---|---|---|---|---|\n"
    )

    def cell(x: object) -> str:
        return _short(str(x)).replace("|", "/").replace("\n", " ")

    rows = "".join(
        f"| {cell(r['component'])} | {cell(r['fault'])} | "
        f"{r['named_s'] if r['named_s'] is not None else '-'} | {cell(r['named_by'])} | "
        f"{cell(_seconds(r, 'console_s'))} | {cell(_seconds(r, 'status_s'))} | {cell(r['line'])} | {cell(r['outcome'])} | {cell(r.get('data') or '-')} |\n"
        for r in ROWS
    )
    Path(target).write_text(head + rows)


def _resume(out: Path, *args: str) -> tuple[Run, int]:
    """`hpcrl resume --step -1` (and `args`), once its own trainer (a new pid) trained 2 steps past
    the checkpoint it resumed from."""
    paths = RunPaths(out)
    start = checkpoint.latest_complete(paths)
    assert start is not None
    old = json.loads(paths.placement_file("trainer", 0).read_text())["pid"]
    run = _start(out, "resume", "--step", "-1", "--output-dir", str(out), *args)

    def trained() -> bool:
        try:
            doc = json.loads((paths.progress_dir / "trainer_0.json").read_text())
        except (OSError, ValueError):
            return False
        return doc["pid"] != old and (doc.get("step") or 0) >= start + 2

    _until(lambda: trained() or run.proc.poll() is not None, 240, "2 steps after resuming")
    assert run.proc.poll() is None, run.output()
    return run, start


def trainer_storage_read_only(run: Run, hold: float) -> None:
    """The last resume: broadcasts/, then checkpoints/ read-only (their tmpfs remounted `ro`: EROFS)
    for less than storage_timeout_s. The trainer names each at once (path, errno, free space),
    retries with backoff, writes once it clears, and the run finishes with exit 0."""
    for d, what in ((run.paths.broadcasts_dir, "policy"), (run.paths.checkpoints_dir, "checkpoint step")):
        refused(
            run,
            "trainer",
            {
                "component": f"trainer ({'weight publish' if what == 'policy' else 'checkpoint'})",
                "fault": f"{d.name}/ read-only (its tmpfs remounted ro: EROFS) for {hold:.0f} s",
                "outcome": f"{RETRIED}; the run finishes with exit 0",
            },
            lambda d=d: _remount(d, "ro"),
            lambda d=d: _remount(d, "rw"),
            [f"cannot write {what}", "read-only filesystem at " + str(d), "EROFS", "free of"],
            hold,
            240,  # the trainer must first train a step: slow when the machine is loaded (CI's two lanes)
        )


def checkpoint_disk_full(out: Path, hold: float, storage_s: float, quota: dict | None = None) -> None:
    """Resume; once it wrote a checkpoint of its own, fill checkpoints/ (its tmpfs) for less than
    storage_timeout_s: named, retried, written once it clears, the run goes on. Then fill it for
    good: past storage_timeout_s the run ends with one line naming the role, the path and the
    field; the half-written step never counts as complete, the next resume starts from the last
    good one. With `quota` (quota.quota_env), a brief EDQUOT on checkpoints/ in between."""
    run, start = _resume(out)
    paths = run.paths
    try:
        _until(lambda: (checkpoint.latest_complete(paths) or 0) > start, 240, "a checkpoint after resuming")
        filler: list[Filler] = []
        refused(
            run,
            ("trainer", "orchestrator"),
            {
                "component": "{role} (checkpoint)",
                "fault": f"disk full writing a checkpoint (checkpoints/ a 1 GB tmpfs, filled) for {hold:.0f} s",
                "outcome": RETRIED,
            },
            lambda: filler.append(Filler(paths.checkpoints_dir)),
            lambda: filler[-1].stop(),
            ["cannot write checkpoint step", "disk full at " + str(paths.checkpoints_dir), "ENOSPC"],
            hold,
            240,  # the trainer must first train a step: slow when the machine is loaded (CI's two lanes)
        )
        good = checkpoint.latest_complete(paths)
        _until(
            lambda: (checkpoint.latest_complete(paths) or 0) > good,
            120,
            "a checkpoint after the disk cleared",
        )
        if quota is not None:  # the same, the user's quota of that disk exhausted (quota.py): EDQUOT
            quota_refused(
                run,
                ("trainer", "orchestrator"),
                {"component": "{role} (checkpoint)", "outcome": RETRIED},
                quota,
                paths.checkpoints_dir,
                "cannot write checkpoint step",
                hold,
                240,
            )
            good = checkpoint.latest_complete(paths)
            _until(lambda: (checkpoint.latest_complete(paths) or 0) > good, 120, "a checkpoint after quota")
        good = checkpoint.latest_complete(paths)
        filler.append(Filler(paths.checkpoints_dir))
        # the console and `hpcrl status` name it while the writer retries (before the run ends)
        full = "disk full at " + str(paths.checkpoints_dir)
        seen = Named(
            run.console,
            paths.root,
            ("trainer", "orchestrator"),
            console_names=["cannot write checkpoint", full, "ENOSPC"],
            status_names=["waiting on writing checkpoint", full, "ENOSPC"],
        )
        t0 = seen.t0
        try:
            _until(lambda: seen.poll() or run.proc.poll() is not None, storage_s + 180, "the run's end")
            assert seen.console_s is not None and seen.status_s is not None, f"missing {seen.missing()}"
            _, stderr = run.communicate(timeout=storage_s + 180)
        finally:
            filler[-1].stop()
        took = time.monotonic() - t0
        assert max(seen.console_s, seen.status_s) < took, (seen.cells(), took)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    last = (stderr.strip().splitlines() or ["-"])[-1]
    assert run.proc.returncode != 0, last
    assert "disk full at " + str(paths.checkpoints_dir) in last and "No space left on device" in last, last
    assert "trainer failed" in last or "orchestrator failed" in last, last
    assert f"(storage_timeout_s = {storage_s:g})" in last, last
    # `good` was read while the next checkpoint could be in flight (deep verification takes a while on
    # 2 busy cores): that one may still complete before the disk is full. What must hold is that no
    # step after the newest valid checkpoint has a COMPLETE, and that one is left half written.
    newest = checkpoint.latest_complete(paths)
    assert newest is not None and newest >= good, (newest, good)
    partial = [s for s in checkpoint.list_steps(paths) if s > newest]
    assert partial, "the failed checkpoint left no step_N behind: the case did not happen"
    assert all(not paths.complete_file(s).exists() for s in partial), partial
    ROWS.append(
        {
            "component": "trainer / orchestrator (checkpoint part)",
            "fault": f"disk full writing a checkpoint past storage_timeout_s ({storage_s:.0f} s)",
            "named_s": round(took, 1),
            "named_by": "launcher (the writer's last ERROR line)",
            "line": f"{last[:180]} … {last[-150:]}",  # the end names the field
            "outcome": f"run ends (exit {run.proc.returncode}); step_{partial[0]} never COMPLETE; "
            f"resume continues from step_{newest}",
            **seen.cells(),  # its WARNING line and its status row, while it retried
        }
    )


def quota_refused(
    run: Run,
    role: str | tuple[str, ...],
    row: dict,
    quota: dict,
    d: Path,
    what: str,
    hold: float,
    within: float,
) -> None:
    """refused() with `d` over quota (EDQUOT from libc's own calls, every process of the run: quota.py)
    for `hold` s."""
    from tests.integration.quota import Quota

    q = Quota(quota, d)
    refused(
        run,
        role,
        {**row, "fault": f"quota exceeded on {d.name}/ (EDQUOT) for {hold:.0f} s"},
        q.start,
        q.stop,
        [what, "disk quota exceeded at " + str(d), "EDQUOT", "free of"],
        hold,
        within,
    )


def resumed_then(out: Path, role: str, expected: str, pid_of) -> None:
    """Resume, then kill -9 `role`: the run ends with one line naming it."""
    run, _ = _resume(out)
    try:
        os.kill(pid_of(run), signal.SIGKILL)
        seen = ended_watch(run, expected)
        _, stderr = run.communicate(timeout=120)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    last = (stderr.strip().splitlines() or ["-"])[-1]
    assert run.proc.returncode != 0 and expected in last, last
    ROWS.append(
        {
            "component": role,
            "fault": "kill -9",
            "named_s": 0,
            "named_by": "launcher",
            "line": last[:220],
            "outcome": f"run ends (exit {run.proc.returncode}); resume continues",
            **seen.cells(),
        }
    )
