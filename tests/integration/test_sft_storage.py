"""The SFT trainer under the storage policy (hpcrl.storage, issue 52): a real `hpcrl sft` whose
checkpoints/ the filesystem refuses, made unwritable (`chattr +i` as root, chmod 0555 as a user),
over quota (EDQUOT from libc for every process of the run: tests/integration/quota.py) or full (its
own small tmpfs, filled: a real ENOSPC; root only). Briefly refused: named once, retried, the run
finishes with exit 0 and complete checkpoints. Refused past storage_timeout_s: the run ends in one
line naming the role, the path and the field, and `hpcrl status` says so afterwards (`ended:`).
Either way `hpcrl sft`'s console and `hpcrl status` name the refused write while it is retried, and
no tmp file is left behind. Where a fault cannot be made here, its rows say it was not run. Rows of
docs/fault_matrix.md (scripts/fault_matrix.sh)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl import checkpoint
from hpcrl.fileio import is_tmp
from hpcrl.paths import RunPaths
from tests.conftest import child_env
from tests.integration.faults import RETRIED, Filler, _make_unwritable, _mount_tmpfs, _until, row
from tests.integration.naming import Console, Named, status_text
from tests.integration.quota import Quota, quota_env, quota_unavailable
from tests.integration.test_sft import REPO, write_config

COMPONENT = "SFT trainer (checkpoint)"
FULL_SIZE = "24m"  # checkpoints/'s tmpfs: the tiny model's two checkpoints (4.4 MB each) fit once freed
KIND = {
    "unwritable": "unwritable (chattr +i / chmod 0555)",
    "quota": "quota exceeded (EDQUOT)",
    "full": f"full (its own {FULL_SIZE} tmpfs, filled: ENOSPC)",
}


def _sft(cfg: Path, extra: dict[str, str] | None = None) -> subprocess.Popen:
    env = child_env(OMP_NUM_THREADS="1", **(extra or {}))
    cmd = [sys.executable, "-m", "hpcrl.cli", "sft", str(cfg)]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def data(tmp_path: Path) -> Path:
    from hpcrl.trainer.sft_data import make_demo

    return make_demo(tmp_path / "data" / "train.jsonl", "reverse-text", n=200, seed=0)[0]


def _named(proc: subprocess.Popen, out: Path, cause: str) -> Named:
    """When `hpcrl sft`'s console (its stderr: the trainer logs there) and `hpcrl status` name the
    refused checkpoint, timed from now (the start: the refusal is there before step 2)."""
    return Named(
        Console(proc.stdout, proc.stderr),
        out,
        "trainer",
        console_names=["sft trainer: cannot write checkpoint step 2", cause],
        status_names=["waiting on writing checkpoint step 2", cause],
    )


def _unavailable(fault: str, tmp_path: Path) -> str | None:
    """Why `fault` cannot be made here (None: it can)."""
    if fault == "quota":
        return quota_unavailable()
    if fault != "full":
        return None
    if os.geteuid() != 0:
        return "not root: checkpoints/ cannot be its own tmpfs (mount -t tmpfs) here"
    probe = tmp_path / "tmpfs-probe"
    why = _mount_tmpfs(probe, "1m")
    if why is None:
        subprocess.run(["umount", str(probe)], check=True)
    return why


class _Refusal:
    """checkpoints/ of `out` refused (made at once) until undo(); close() after the run: undone, and a
    tmpfs it mounted unmounted. `cause`: the words the console, `hpcrl status` and the last line
    name it by; `errno`: what the last line says besides."""

    def __init__(self, fault: str, tmp_path: Path, out: Path):
        self.fault, self.dir = fault, RunPaths(out).checkpoints_dir
        self.dir.mkdir(parents=True)
        self.env: dict[str, str] = {}
        self.cause, self.errno = "not writable (", ""
        self.mounted, self.undone = False, False
        if fault == "quota":
            ctl = tmp_path / f"{out.name}-quota"
            ctl.mkdir()
            self.env = quota_env(ctl) or {}
            self.q = Quota(self.env, self.dir).start()
            self.cause, self.errno = "disk quota exceeded at ", "EDQUOT"
        elif fault == "full":  # a real ENOSPC: its own small tmpfs, kept full (faults.Filler)
            why = _mount_tmpfs(self.dir, FULL_SIZE)
            assert why is None, why
            self.mounted = True
            self.filler = Filler(self.dir)
            self.cause, self.errno = f"disk full at {self.dir}", "ENOSPC"
        else:
            self.how, self.cmd = _make_unwritable(self.dir)

    def undo(self) -> None:
        if self.undone:
            return
        self.undone = True
        if self.fault == "quota":
            self.q.stop()
        elif self.fault == "full":
            self.filler.stop()
        else:
            subprocess.run(self.cmd, check=False)

    def tmp_left(self) -> list[Path]:
        """Tmp files and directories a writer left in checkpoints/ (hpcrl.fileio's tmp names)."""
        return [p for p in self.dir.rglob("*") if is_tmp(p)]

    def close(self) -> None:
        self.undo()
        if self.mounted:  # lazily: a process of a failed test may still hold a file there
            subprocess.run(["umount", "-l", str(self.dir)], check=False)
            self.mounted = False


def _ended_line(out: Path) -> str | None:
    """`hpcrl status`'s `ended:` line: what ended the run, as its launcher recorded it."""
    return next((x for x in status_text(out).splitlines() if x.startswith("ended:")), None)


def _briefly(kind: str) -> str:
    return (
        f"checkpoints/ {kind} from the start (timed from `hpcrl sft`), cleared 1.5 s after the "
        "console and `hpcrl status` named it"
    )


def _for_good(kind: str) -> str:
    return f"checkpoints/ {kind} for good, storage_timeout_s = 2 (timed from `hpcrl sft`)"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault", ["unwritable", "quota", "full"])
def test_sft_checkpoints_wait_out_a_refusal_and_end_in_one_line_past_the_bound(
    tiny_model_dir: Path, data: Path, tmp_path: Path, fault: str
) -> None:
    kind = KIND[fault]
    if why := _unavailable(fault, tmp_path):
        for case in (_briefly(kind), _for_good(kind)):
            row(COMPONENT, case, None, "-", why, "not run here", "- (not run)", "- (not run)", "- (not run)")
        pytest.skip(f"checkpoints/ {kind} cannot be made here: {why}")
    out = tmp_path / "run"
    paths = RunPaths(out)
    refusals: list[_Refusal] = []
    try:
        refusals.append(_Refusal(fault, tmp_path, out))
        cause = (refusals[0].cause, refusals[0].errno)
        # refused for good, storage_timeout_s = 2: one line at the first checkpoint (step 2)
        proc = _sft(
            write_config(tmp_path / "a.toml", tiny_model_dir, data, out, storage_timeout_s="2"),
            refusals[0].env,
        )
        ended_seen = _named(proc, out, cause[0])
        t0 = ended_seen.t0
        _until(lambda: ended_seen.poll() or proc.poll() is not None, 300, "the sft trainer's end")
        proc.wait(300)
        took, ended = time.monotonic() - t0, proc.returncode
        ended_seen.out.join()
        err = ended_seen.out.text(1)
        last = err.strip().splitlines()[-1]
        assert proc.returncode != 0, err[-3000:]
        assert "sft trainer failed: cannot write checkpoint step 2 for 2 s: " + cause[0] in last, last
        assert cause[1] in last, last
        assert str(paths.checkpoints_dir) in last and last.endswith("(storage_timeout_s = 2)"), last
        assert checkpoint.latest_complete(paths) is None
        assert not paths.complete_file(2).exists()
        assert not refusals[0].tmp_left(), refusals[0].tmp_left()
        # `hpcrl status` says what ended it once the run is over: the line it ended with
        said_ended = _ended_line(out)
        assert said_ended is not None, status_text(out)
        assert last.split("] ", 1)[-1].strip() in said_ended, (said_ended, last)
        assert said_ended.endswith(f"(exit {ended})"), said_ended
        # named on the console and in `hpcrl status` while it retried, before the run ended
        assert ended_seen.console_s is not None and ended_seen.status_s is not None, ended_seen.missing()
        assert max(ended_seen.console_s, ended_seen.status_s) < took, (ended_seen.cells(), took)
        # refused until the console and `hpcrl status` name it, then cleared: the run finishes with
        # both checkpoints
        out2 = tmp_path / "run2"
        paths2 = RunPaths(out2)
        refusals.append(_Refusal(fault, tmp_path, out2))
        proc = _sft(
            write_config(tmp_path / "b.toml", tiny_model_dir, data, out2, storage_timeout_s="120"),
            refusals[1].env,
        )
        seen = _named(proc, out2, refusals[1].cause)  # full: its own tmpfs's path
        _until(
            lambda: seen.poll() or proc.poll() is not None,
            300,
            "the sft trainer naming the refused checkpoint",
        )
        assert proc.poll() is None, seen.out.text(1)[-3000:]
        named_s = seen.console_s  # from the start: the refusal was there before step 2
        time.sleep(1.5)
        refusals[1].undo()
        proc.wait(300)
        seen.out.join()
        err = seen.out.text(1)
        assert proc.returncode == 0, err[-3000:]
        assert cause[1] in seen.console_line, seen.console_line
        assert "sft trainer: wrote checkpoint step 2 after" in err, err[-3000:]
        assert checkpoint.verify(paths2, 2) is None and checkpoint.verify(paths2, 4) is None
        assert checkpoint.latest_complete(paths2) == 4
        assert not refusals[1].tmp_left(), refusals[1].tmp_left()
        assert (_ended_line(out2) or "").endswith("hpcrl: run finished (exit 0)"), status_text(out2)
    finally:
        for r in refusals:
            r.close()
    said = seen.console_line.strip().split("] ", 1)[-1]
    row(
        COMPONENT,
        _briefly(kind),
        named_s,
        "sft trainer (console)",
        said[:240],
        RETRIED + "; exit 0",
        "checkpoints 2 and 4 complete and verified (checkpoint.verify); no tmp left; status "
        "`ended: hpcrl: run finished (exit 0)`",
        seen.console_s,
        seen.status_s,
    )
    row(
        COMPONENT,
        _for_good(kind),
        took,
        "hpcrl sft (its last line)",
        f"{last.split('] ', 1)[-1][:170]} … {last[-90:]}",
        f"run ends (exit {ended}) at its first checkpoint",
        "no step_2 COMPLETE: no checkpoint taken for complete; no tmp left; `hpcrl status` then "
        "says `ended:` with that line",
        ended_seen.console_s,
        ended_seen.status_s,
    )
