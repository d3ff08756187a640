"""The fault matrix's rows for disks that hold logs, and read-only rollouts/ (the shared run of
tests/integration/test_fault_matrix.py): the env's log directory full, over quota or read-only while
the env server has something to say (its worker killed or frozen), the inference server's log file
full, read-only or over quota while it serves, rollouts/ remounted read-only under the orchestrator.

A log never ends a role (hpcrl.storage's tolerant handlers drop and count the lines the disk refuses):
what is asserted is that the role goes on, that the lost lines are named where a console reads
(the orchestrator's WARNING: an env server's Pong, an inference server's /metrics) and in `hpcrl
status`, and by the role itself once it can write again.

Where a fault cannot be made for real here it is made by the LD_PRELOAD shim (quota.py, edquot.c)
with the errno it would have: a quota (no CONFIG_QUOTA), and a read-only log directory or log file,
since the kernel refuses `mount -o remount,ro` while a file on the filesystem is open for writing
(EBUSY) and the env server and the launcher hold their logs open.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from hpcrl.paths import RunPaths
from tests.integration.faults import (
    RETRIED,
    ROWS,
    Filler,
    Run,
    _mount_tmpfs,
    _not_run,
    _remount,
    _until,
    refused,
)
from tests.integration.naming import Watch
from tests.integration.quota import Quota

LOST = "log line(s) lost"
SHIM_RO = "EROFS from the LD_PRELOAD shim: `remount,ro` says EBUSY while a file there is open for writing"
ENV_DIR = "logs/envs/train/reverse-text/"
ENV_DISK = "16m"  # the env's log directory: its own tmpfs (disk full)
INF_DISK = "4m"  # the tmpfs holding the inference server's log file (bind-mounted over logs/inference.log)


# -- the disks, mounted before the run starts ----------------------------------------------------------
def mount_log_disks(out: Path, tmp_path: Path) -> str | None:
    """The env's log directory a small tmpfs of its own, and logs/inference.log a file on another
    (`mount --bind` of a file over the log file: the launcher's append-open lands on it); None, or
    why they cannot be mounted (not root)."""
    paths = RunPaths(out)
    why = _mount_tmpfs(paths.env_server_dir("train", "reverse-text"), ENV_DISK)
    why = why or _mount_tmpfs(tmp_path / "inference-disk", INF_DISK)
    if why is not None:
        return why
    (tmp_path / "inference-disk" / "inference.log").touch()
    paths.log_file("inference").touch()
    res = subprocess.run(
        [
            "mount",
            "--bind",
            str(tmp_path / "inference-disk" / "inference.log"),
            str(paths.log_file("inference")),
        ],
        capture_output=True,
        text=True,
    )
    return None if res.returncode == 0 else f"mount --bind refused: {(res.stderr or res.stdout).strip()}"


def unmount_log_disks(out: Path, tmp_path: Path) -> None:
    paths = RunPaths(out)
    for p in (
        paths.log_file("inference"),
        tmp_path / "inference-disk",
        paths.env_server_dir("train", "reverse-text"),
    ):
        if os.path.ismount(p) or p.is_file():
            subprocess.run(["umount", "-l", str(p)], check=False, capture_output=True)


def logs_refused(run: Run, hold: float, quota: dict | None, no_tmpfs: str | None, disk: Path) -> None:
    """The shared run's rows for the logs' disks: the env's log directory over quota, full, read-only
    (the shim's EROFS), then the inference server's log file full, read-only, over quota. A fault
    that cannot be made here (not root: no tmpfs; no gcc: no shim) is a row saying so."""
    shim = None if quota is not None else "no LD_PRELOAD shim (quota.quota_unavailable)"
    for how, why in (("quota", shim), ("full", no_tmpfs), ("ro", shim)):
        if why is None:
            env_logs_refused(run, how, hold, quota)
        else:
            ROWS.append(_not_run("env server, env worker (their logs)", how, why))
    for how, why in (("full", no_tmpfs), ("ro", shim), ("quota", shim)):
        if why is None:
            inference_log_refused(run, how, hold, quota, disk)
        else:
            ROWS.append(_not_run("inference server (its log)", how, why))


# -- rollouts/ read-only (a real EROFS) ----------------------------------------------------------------
def rollouts_read_only(run: Run, hold: float, within: float) -> None:
    """rollouts/ (its own tmpfs) remounted `ro` for `hold` s (faults._remount tries again while the
    kernel says EBUSY: a batch being written): the orchestrator names `read-only filesystem at
    …/rollouts/…`, retries, writes once it cleared."""
    d = run.paths.rollouts_dir
    refused(
        run,
        "orchestrator",
        {
            "component": "bus (orchestrator writing rollouts/)",
            "fault": f"rollouts/ read-only (its tmpfs remounted ro: EROFS) for {hold:.0f} s",
            "outcome": RETRIED,
        },
        lambda: _remount(d, "ro"),
        lambda: _remount(d, "rw"),
        ["cannot write rollouts", "read-only filesystem at " + str(d), "EROFS", "free of"],
        hold,
        within,
    )


# -- the env's log directory -----------------------------------------------------------------------
def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def env_logs_refused(run: Run, how: str, hold: float, quota: dict | None) -> None:
    """The train env's log directory (server.log, worker_0.log, components.json) refused for `hold`
    s (`how`: "quota" EDQUOT, "full" its tmpfs filled: ENOSPC, "ro" EROFS) while the env server has
    something to log: its worker killed, and restarted on the refused directory (a worker log that
    cannot be opened: hpcrl.storage.open_log, its output relayed once the log can be written; before, the
    env server died of it). The server's lines and its status file are refused,
    dropped, never raised; it stays up (same pid), rollouts go on. Named on the console while
    refused (the orchestrator's line: the server's next Pong carries the lost lines), by the server
    itself once it can write (its first line then, at the next worker kill), and in `hpcrl status`
    once its components.json can be written again (`running (N log line(s) lost)`)."""
    d = run.paths.env_server_dir("train", "reverse-text")
    server, worker = run.pid("env-server"), run.pid("env-worker")
    server_log, mark = d / "server.log", len(run.log("orchestrator"))
    size = server_log.stat().st_size
    fault, cause = {
        "quota": (f"quota exceeded on {ENV_DIR} (EDQUOT)", "disk quota exceeded at"),
        "full": (f"disk full ({ENV_DIR} a {ENV_DISK[:-1]} MB tmpfs, filled)", "disk full at"),
        "ro": (f"{ENV_DIR} read-only ({SHIM_RO})", "read-only filesystem at"),
    }[how]
    start, stop = _fault(how, quota, d, d, server_log, d / "worker_0.log")
    prev = json.loads((d / "components.json").read_text())["server"].get("log_lines_lost", 0)
    seen = Watch(
        run.console,
        run.paths.root,
        [[f"(pid {server}): ", LOST]],
        _counts(prev, "env-server", "train/reverse-text"),
    )
    t0 = seen.t0
    start()
    try:
        os.kill(worker, signal.SIGKILL)
        died = f"env worker 0 (pid {worker}) died"
        _until(lambda: died in run.log("orchestrator")[mark:], 60, "the orchestrator naming the dead worker")
        _until(lambda: seen.poll() or seen.console_s is not None, 60, "the console naming the lost lines")
        run.wait_steps(2)  # rollouts go on
        grown = server_log.stat().st_size - size  # the padding only (_pad), when full
        assert grown == (-size % PAGE if how == "full" else 0), f"the env server wrote {grown} B to its log"
        time.sleep(max(0.0, hold - (time.monotonic() - t0)))
    finally:
        stop()
    assert run.pid("env-server") == server
    new = [p for p in _children(server) if p != worker]
    assert new, f"env server {server} has no worker"
    os.kill(new[0], signal.SIGKILL)  # its next line (the restart) says what was lost
    _until(
        lambda: LOST in server_log.read_text(errors="replace")[size:], 60, "the env server's lost-lines note"
    )
    took = time.monotonic() - t0
    _until(seen.poll, 60, "`hpcrl status` naming the lost lines")
    text = server_log.read_text(errors="replace")[size:]
    line = re.search(r"\d+ log line\(s\) lost: .*", text)
    assert line is not None and f"{cause} {server_log}" in line.group(0), text[-2000:]  # the stream's file
    run.wait_steps(2)
    assert run.pid("env-server") == server
    ROWS.append(
        {
            "component": "env server, env worker (their logs, status file)",
            "fault": f"{fault} for {hold:.0f} s, its worker killed meanwhile",
            "named_s": round(took, 1),
            "named_by": "env server (its first line once it could write)",
            "line": line.group(0)[:200],
            "outcome": "lines dropped, never raised; worker restarted (a log it cannot open: its output "
            "relayed once it can be written), the env server never restarted; run goes on",
            # the console: the orchestrator's line (the server's next Pong, while refused); `hpcrl
            # status`: its components.json, written again once it cleared
            **seen.cells(),
        }
    )


PAGE = 4096  # tmpfs allocates a file's space a page at a time


def _pad(log: Path) -> None:
    """Fill the last page of `log` (appended, as its writer appends): a full tmpfs still takes what
    fits in the page a file already has, so the role's next lines would not be refused at once."""
    size = log.stat().st_size if log.exists() else 0
    if size % PAGE:
        note = "(fault matrix: this log padded to the end of its page, so that the full disk refuses its next line)"
        with open(log, "ab") as f:
            f.write((note + " " * PAGE)[: PAGE - size % PAGE - 1].encode() + b"\n")


def _fault(how: str, quota: dict | None, disk: Path, target: Path, *logs: Path) -> tuple:
    """(start, stop) of the fault: "full" fills the tmpfs `disk` (faults.Filler: a real ENOSPC; `logs`
    padded to their page's end first), "quota" / "ro" list `target` in the shim's control file with
    EDQUOT / EROFS (quota.Quota)."""
    if how == "full":
        filler: list[Filler] = []

        def fill() -> None:
            for log in logs:
                _pad(log)
            filler.append(Filler(disk))

        return fill, (lambda: filler[-1].stop())
    assert quota is not None, "the shim is needed (quota.quota_env)"
    q = Quota(quota, target, errno="EROFS" if how == "ro" else "EDQUOT")
    return q.start, q.stop


# -- the inference server's log file ------------------------------------------------------------------
def _lost_count(run: Run) -> int:
    """The lost log lines of inference server 0 as the orchestrator's /metrics poller last read them
    (its progress file, what `hpcrl status` shows beside the server: `(N log line(s) lost)`); the
    server's /metrics itself wants the run's API key."""
    for _ in range(50):  # a progress file being replaced: read it again
        try:
            doc = json.loads((run.paths.progress_dir / "orchestrator.json").read_text())
            break
        except (OSError, ValueError):
            time.sleep(0.1)
    else:
        raise AssertionError("the orchestrator's progress file cannot be read")
    lost = doc.get("servers_log_lost") or {}
    n = next((v for k, v in lost.items() if k.startswith("inference server 0")), None)
    if n is not None:
        return int(n)
    state = next((v for k, v in (doc.get("servers") or {}).items() if k.startswith("inference server 0")), "")
    m = re.search(rf"\((\d+) {re.escape(LOST)}\)", state)  # the state itself (before servers_log_lost)
    return int(m.group(1)) if m else 0


def _counts(prev: int, *names: str) -> list[list]:
    """The status alternative naming more lost lines than `prev` (a count shown before stays shown)."""

    def more(line: str) -> bool:
        return any(int(n) > prev for n in re.findall(rf"\((\d+) {re.escape(LOST)}\)", line))

    return [[*names, more]]


def inference_log_refused(run: Run, how: str, hold: float, quota: dict | None, disk: Path) -> None:
    """logs/inference.log (the launcher's file: the server's stdout and stderr) refused for `hold` s
    (`how`: "full" the tmpfs it is bind-mounted from filled, "ro" EROFS and "quota" EDQUOT from the
    shim) while the server serves: each policy load's line (`loaded policy N …`) is dropped and
    counted (its /metrics `hpcrl:log_lines_lost_total`), and the orchestrator's /metrics poller
    names them, with the cause, on the console and beside the server in `hpcrl status`. The server
    serves on (same pid, steps advance); nothing raised in its log once it can write again."""
    log = run.paths.log_file("inference")
    pid, size, before = run.pid("inference"), log.stat().st_size, _lost_count(run)
    fault, cause = {
        "full": (f"disk full (logs/inference.log on a {INF_DISK[:-1]} MB tmpfs, filled)", "disk full at"),
        "ro": (f"logs/inference.log read-only ({SHIM_RO})", "read-only filesystem at"),
        "quota": ("quota exceeded on logs/inference.log (EDQUOT)", "disk quota exceeded at"),
    }[how]
    start, stop = _fault(how, quota, disk, log, log)
    named = ["inference server 0", LOST, cause]
    seen = Watch(run.console, run.paths.root, [named], _counts(before, "inference server 0"))
    mark = len(run.log("orchestrator"))

    def said() -> str | None:
        new = run.log("orchestrator")[mark:].splitlines()
        return next((x for x in new if all(n in x for n in named)), None)

    t0 = seen.t0
    start()
    try:
        _until(lambda: (seen.poll(), said() is not None)[1], hold + 60, "the orchestrator naming lost lines")
        took = time.monotonic() - t0
        _until(seen.poll, 60, "the console and `hpcrl status` naming the server's lost lines")
        run.wait_steps(2)  # it serves on: the orchestrator's rollouts advance
        _until(lambda: time.monotonic() - t0 >= hold, hold + 60, f"{hold:.0f} s")
        lost = _lost_count(run) - before
    finally:
        stop()
    run.wait_steps(2)
    assert run.pid("inference") == pid, "the inference server was restarted"
    after = log.read_text(errors="replace")[size:]
    assert "Traceback" not in after, after[-3000:]
    assert lost > 0, f"{lost} line(s) lost"
    line = said() or ""
    ROWS.append(
        {
            "component": "inference server (its log)",
            "fault": f"{fault} for {hold:.0f} s",
            "named_s": round(took, 1),
            "named_by": "orchestrator (the server's /metrics)",
            "line": line.split("] ", 1)[-1][:220],
            "outcome": "serves on (same pid, steps advance); its lines dropped and counted, never raised",
            **seen.cells(),
        }
    )
