"""The SFT trainer under the storage policy (hpcrl.storage, issue 52): a real `hpcrl sft` whose
checkpoints/ the filesystem refuses, made unwritable (`chattr +i` as root, chmod 0555 as a user) or
over quota (EDQUOT from libc for every process of the run: tests/integration/quota.py). Briefly
refused: named once, retried, the run finishes with exit 0 and complete checkpoints. Refused past
storage_timeout_s: the run ends in one line naming the role, the path and the field. Either way
`hpcrl sft`'s console and `hpcrl status` name the refused write while it is retried. Rows of
docs/fault_matrix.md (scripts/fault_matrix.sh)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl import checkpoint
from hpcrl.paths import RunPaths
from tests.conftest import child_env
from tests.integration.faults import RETRIED, _make_unwritable, _until, row
from tests.integration.naming import Console, Named
from tests.integration.quota import Quota, quota_env, quota_unavailable
from tests.integration.test_sft import REPO, write_config


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


class _Refusal:
    """checkpoints/ of `out` refused (make) until undo()."""

    def __init__(self, fault: str, tmp_path: Path, out: Path):
        self.fault, self.dir = fault, RunPaths(out).checkpoints_dir
        self.dir.mkdir(parents=True)
        self.env: dict[str, str] = {}
        if fault == "quota":
            ctl = tmp_path / f"{out.name}-quota"
            ctl.mkdir()
            self.env = quota_env(ctl) or {}
            self.q = Quota(self.env, self.dir).start()
        else:
            self.how, self.cmd = _make_unwritable(self.dir)

    def undo(self) -> None:
        if self.fault == "quota":
            self.q.stop()
        else:
            subprocess.run(self.cmd, check=False)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fault", ["unwritable", "quota"])
def test_sft_checkpoints_wait_out_a_refusal_and_end_in_one_line_past_the_bound(
    tiny_model_dir: Path, data: Path, tmp_path: Path, fault: str
) -> None:
    if fault == "quota" and quota_unavailable():
        pytest.skip(f"no quota can be made here: {quota_unavailable()}")
    cause = ("disk quota exceeded at ", "EDQUOT") if fault == "quota" else ("not writable (", "")
    kind = "quota exceeded (EDQUOT)" if fault == "quota" else "unwritable (chattr +i / chmod 0555)"
    out = tmp_path / "run"
    paths = RunPaths(out)
    refusals = [_Refusal(fault, tmp_path, out)]
    try:
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
        seen = _named(proc, out2, cause[0])
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
        assert checkpoint.verify(paths2, 2) is None and checkpoint.latest_complete(paths2) == 4
    finally:
        for r in refusals:
            r.undo()
    said = seen.console_line.strip().split("] ", 1)[-1]
    row(
        "SFT trainer (checkpoint)",
        f"checkpoints/ {kind} from the start (timed from `hpcrl sft`), cleared 1.5 s after the "
        "console and `hpcrl status` named it",
        named_s,
        "sft trainer (console)",
        said[:240],
        RETRIED + "; exit 0",
        "checkpoints 2 and 4 complete and verified (checkpoint.verify)",
        seen.console_s,
        seen.status_s,
    )
    row(
        "SFT trainer (checkpoint)",
        f"checkpoints/ {kind} for good, storage_timeout_s = 2 (timed from `hpcrl sft`)",
        took,
        "hpcrl sft (its last line)",
        f"{last.split('] ', 1)[-1][:170]} … {last[-90:]}",
        f"run ends (exit {ended}) at its first checkpoint",
        "no step_2 COMPLETE: no checkpoint taken for complete",
        ended_seen.console_s,
        ended_seen.status_s,
    )
