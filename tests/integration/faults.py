"""The fault matrix's tools (tests/integration/test_fault_matrix.py): a run under test, waits, the
faults that need more than a signal (a full disk, an unwritable directory), and the table."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hpcrl.paths import RunPaths

ROWS: list[dict] = []  # the table: one row per case


def _hpcrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcrl.cli", *args]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


@dataclass
class Run:
    proc: subprocess.Popen
    paths: RunPaths

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

    def output(self) -> str:
        if self.proc.poll() is None:
            return ""
        out, err = self.proc.communicate()
        return (out or "")[-3000:] + (err or "")[-3000:]


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
    }


def _write_table() -> None:
    target = os.environ.get("HPCRL_FAULT_TABLE")
    if not target:
        return
    head = (
        "| component | fault | named after (s) | named by | what it said / outcome |\n|---|---|---|---|---|\n"
    )
    rows = "".join(
        f"| {r['component']} | {r['fault']} | {r['named_s'] if r['named_s'] is not None else '-'} | "
        f"{r['named_by']} | {r['line'].replace('|', '/')} — {r['outcome']}"
        f"{'; ' + r['data'] if r.get('data') else ''} |\n"
        for r in ROWS
    )
    Path(target).write_text(head + rows)
