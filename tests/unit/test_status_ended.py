"""`hpcrl status` of a run that ended: its `ended:` line is the launcher's last line (which role
ended it and why), written to the job file by hpcrl.launch.local.ended (issue 52: a killed role is
named in status once the console is gone)."""

from __future__ import annotations

import contextlib
import io

from hpcrl.launch.local import ended
from hpcrl.launch.manage import read_job, status, write_job
from hpcrl.paths import RunPaths


def test_the_last_line_of_a_run_is_in_its_status(tmp_path) -> None:
    paths = RunPaths(tmp_path / "run")
    (paths.root / "configs").mkdir(parents=True)
    write_job(paths, {"target": "local", "pid": 2**22 + 12345, "started_at": 0})  # no such pid
    ended(paths, 1, "hpcrl: orchestrator was killed by signal 9; see …/orchestrator.log")
    assert read_job(paths)["target"] == "local"  # kept
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status([str(paths.root)])
    line = next(x for x in out.getvalue().splitlines() if x.startswith("ended:"))
    assert (
        line.split(None, 1)[1]
        == "hpcrl: orchestrator was killed by signal 9; see …/orchestrator.log (exit 1)"
    )
