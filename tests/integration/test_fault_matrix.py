"""The fault matrix (issue 40): components x faults on one real `hpcrl run`, each fault named within
its bound, the run surviving what it can, and `hpcrl resume --step -1` continuing without a prompt
skipped or repeated.

The cases share runs (a run per case would cost minutes each on 2 cores). Run 1 goes through every
freeze in turn (SIGSTOP shorter than the stall bound, past it, an env worker and an env server past
2x the bound, every component briefly), kill -9 of the env worker, the env server and the inference
server (each named and replaced), makes rollouts/ unwritable for a while (root: `chattr +i`, since
chmod does not stop root; else chmod 0555), then its disk full (rollouts/ is a 64 MB tmpfs,
filled), then read-only (its tmpfs remounted ro: EROFS), then its quota exceeded (EDQUOT from libc
for every process of the run: tests/integration/quota.py), then the env's log directory over quota,
full and read-only and the inference server's log file full, read-only and over quota
(faults_logs.py: a log never ends a role, its lost lines are named), freezes the inference server past
server_down_timeout_s, and kill -9 of the orchestrator ends it. Resume A fills checkpoints/ (a 1 GB
tmpfs) for 9 s once it wrote a checkpoint (named, retried, written: the storage policy of issue 52,
hpcrl.storage), then for good: past storage_timeout_s (30 s here) the run ends in one line naming
the role, the path and the field (between the two, checkpoints/ over quota for 9 s: named, retried,
written). Resume B is ended by kill -9 of the trainer. Resume C has broadcasts/ and then
checkpoints/ read-only (their tmpfs remounted ro: EROFS) for 9 s each and reaches max_steps with
exit 0, and the prompts log then holds every step once and no prompt twice. Where tmpfs cannot be
mounted (not root) the disk-full cases are rows saying so. A second group of cases is one short run
each: an env whose every reward raises, an env that cannot import, a verifiers 0.4 tool env under
the `default` renderer.

Every case also asserts that the console of `hpcrl run` and `hpcrl status` name it within its bound
(a freeze under the bound: that neither does), and the table says after how long
(tests/integration/naming.py). `HPCRL_FAULT_TABLE=docs/fault_matrix.md python -m pytest -m slow
tests/integration/test_fault_matrix.py` rewrites the table in docs (scripts/fault_matrix.sh).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from hpcrl import checkpoint
from hpcrl.paths import RunPaths
from tests.conftest import rl_toml
from tests.integration import faults, faults_logs
from tests.integration.faults import (
    RETRIED,
    ROWS,
    Filler,
    Run,
    _env,
    _hpcrl,
    _make_unwritable,
    _mount_tmpfs,
    _new_lines,
    _not_run,
    _resume,
    _start,
    _until,
    _write_table,
    checkpoint_disk_full,
    quota_refused,
    refused,
    resumed_then,
    trainer_storage_read_only,
)
from tests.integration.naming import UNDER, Watch, ended_cells, ended_watch, stall_names, status_text
from tests.integration.quota import quota_env, quota_unavailable

BOUND = 6.0  # stall_warning_s of these runs (the default is 60 s)
DOWN_S = 60.0  # orchestrator.server_down_timeout_s (a restart on 2 busy cores took 25 to 40+ s)
MAX_STEPS = 100000  # run 1 and 2 end by kill -9; the last resume sets its own max_steps
STORAGE_S = 30.0  # storage_timeout_s of these runs (the default is 600 s)
CONFIG = rl_toml(
    "{steps}",
    seq_len=64,
    max_tokens=8,
    top=f"stall_warning_s = {BOUND}\nstorage_timeout_s = {STORAGE_S}\n",
    orchestrator=f"server_down_timeout_s = {DOWN_S}\n",
    tables="[ckpt]\ninterval = 5\nkeep_last = 40\n",  # a long run: checkpoints/ is a 1 GB tmpfs
)


def freeze(run: Run, component: str, role: str, namer: str, names: list[str], *, past: bool) -> None:
    """SIGSTOP `role`'s process; past the bound: until `namer`'s log names it (all of `names`), the
    time measured from the SIGSTOP, and the console and `hpcrl status` too (naming.stall_names), the
    process kept stopped until all three did; briefly: half the bound, and none may name it."""
    pid = run.pid(role)
    names = [n.format(pid=pid) for n in names]
    mark = len(run.log(namer))
    os.kill(pid, signal.SIGSTOP)
    seen = Watch(run.console, run.paths.root, *stall_names(role, pid))
    seen.under = None if past else BOUND
    t0 = seen.t0
    try:
        if past:
            log: list[float] = []

            def named() -> bool:
                new = _new_lines(run.log(namer), mark)
                if not log and any(
                    "no progress for" in line and all(n in line for n in names) for line in new.splitlines()
                ):
                    log.append(time.monotonic() - t0)
                return seen.poll() and bool(log)

            _until(
                named, BOUND + 30, f"{namer}, the console and `hpcrl status` naming the frozen {component}"
            )
            took = log[0]
        else:
            _until(lambda: (seen.poll(), time.monotonic() - t0 > BOUND / 2)[1], BOUND, "half the bound")
            took = None
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    frozen = time.monotonic() - t0
    run.wait_steps(2)
    if not past:
        assert "no progress for" not in _new_lines(run.log(namer), mark)
        seen.quiet()
    line = next(
        (x for x in _new_lines(run.log(namer), mark).splitlines() if "no progress for" in x),
        "-",
    )
    ROWS.append(
        {
            "component": component,
            "fault": f"SIGSTOP {frozen:.0f} s ({'past' if past else 'under'} the {BOUND:.0f} s bound)",
            "named_s": None if took is None else round(took, 1),
            "named_by": namer if past else "- (not a stall)",
            "line": line.split("] ", 1)[-1][:220],
            "outcome": "run goes on",
            **(seen.cells() if past else {"console_s": UNDER, "status_s": UNDER}),
        }
    )


@pytest.mark.slow
@pytest.mark.waits  # freezes past their bounds, a server past server_down_timeout_s
@pytest.mark.timeout(1400)  # 1200 s before the logs rows (faults_logs: about 90 s more)
def test_fault_matrix_one_run_and_its_resumes(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(CONFIG.format(steps=MAX_STEPS))
    out = tmp_path / "run"
    # The disks that fill up or turn read-only: rollouts/, checkpoints/ and broadcasts/ each a small
    # tmpfs of its own (as root).
    no_tmpfs = (
        _mount_tmpfs(out / "rollouts", "64m")
        or _mount_tmpfs(out / "checkpoints", "1g")  # room for 200+ checkpoints of a fast run
        or _mount_tmpfs(out / "broadcasts", "256m")
        # the env's log directory a tmpfs, logs/inference.log a file bind-mounted from another
        or faults_logs.mount_log_disks(out, tmp_path)
    )
    # A quota that runs out (EDQUOT) for every process of the run: tests/integration/quota.py
    quota, first = quota_env(tmp_path), len(ROWS)
    faults.EXTRA_ENV.update(quota or {})
    try:
        run = _start(out, "run", str(cfg), "--output-dir", str(out))
        faults_of_run_1(run, out, no_tmpfs, quota, tmp_path / "inference-disk")
        if no_tmpfs is None:
            checkpoint_disk_full(out, BOUND + 3, STORAGE_S, quota)
        else:
            ROWS.append(_not_run("trainer / orchestrator", "disk full writing a checkpoint", no_tmpfs))
        if quota is None:
            for component in ("bus (orchestrator writing rollouts/)", "env server", "trainer (checkpoint)"):
                ROWS.append(_not_run(component, "quota exceeded (EDQUOT)", quota_unavailable() or "-"))
        resumed_then(
            out,
            "trainer",
            "trainer[0] was killed by signal 9; see",  # its own cause only: none (no ERROR line)
            lambda run: json.loads((run.paths.progress_dir / "trainer_0.json").read_text())["pid"],
        )
        stopped_at = RunPaths(out).prompts_log.read_text().count("\n")
        final = stopped_at + (40 if no_tmpfs is None else 6)
        run, _ = _resume(out, "--max-steps", str(final))
        try:
            if no_tmpfs is None:  # the trainer's storage read-only for a while: the run finishes
                trainer_storage_read_only(run, BOUND + 3)
            else:
                ROWS.append(_not_run("trainer", "read-only storage", no_tmpfs))
            out_, err = run.communicate(timeout=600)
        finally:
            if run.proc.poll() is None:
                run.proc.kill()
        assert run.proc.returncode == 0, out_[-3000:] + err[-3000:]
    finally:
        for k in quota or {}:
            faults.EXTRA_ENV.pop(k, None)
        for d in (out / "rollouts", out / "checkpoints", out / "broadcasts"):
            if os.path.ismount(d):
                subprocess.run(["umount", "-l", str(d)], check=False)
        faults_logs.unmount_log_disks(out, tmp_path)
    prompts = [json.loads(x) for x in RunPaths(out).prompts_log.read_text().splitlines()]
    steps = [p["step"] for p in prompts]
    assert steps == list(range(1, final + 1)), steps
    ids = [i for p in prompts for i in p["example_ids"]]
    assert len(ids) == len(set(ids)), "a prompt was trained on twice"
    data = f"after every resume: steps 1..{final} each once, {len(ids)} prompts, none repeated"
    for r in ROWS[first:]:  # every case of the shared run: its prompts log, checked once it ended
        r.setdefault("data", data)
    _write_table()


def killed(run: Run, component: str, role: str, names: list[str], back: str | None = None, status=()) -> None:
    """kill -9 of `role`'s process mid-run: the orchestrator's log names it (a line with all of
    `names`, timed from the kill), and so do the console (the same line, or the launcher's) and
    `hpcrl status` (a line with all of one of `status`), `back` appears where the replacement says
    so, the run goes on."""
    pid = run.pid(role)
    names = [n.format(pid=pid) for n in names]
    mark = len(run.log("orchestrator"))
    os.kill(pid, signal.SIGKILL)
    console = (
        [names, ["inference", "killed by signal 9", "restarting it"]] if role == "inference" else [names]
    )
    seen = Watch(run.console, run.paths.root, console, [[x.format(pid=pid) for x in a] for a in status])

    def named() -> str | None:
        new = _new_lines(run.log("orchestrator"), mark).splitlines()
        return next((x for x in new if all(n in x for n in names)), None)

    took = _until(
        lambda: (seen.poll(), named() is not None)[1],
        BOUND + 60,
        f"the orchestrator naming the killed {component}",
    )
    line = named()
    # The console prints a line naming a new process however often its message came before, and
    # `hpcrl status` keeps it under "recent warnings" (it used to show the cause only until the
    # replacement): both asserted.
    _until(seen.poll, BOUND + 60 - took, f"the console and `hpcrl status` naming the killed {component}")
    seen.named(BOUND + 60)
    if back is not None:
        _until(lambda: back in run.log("orchestrator")[mark:], DOWN_S + 120, f"the {component} back")
    run.wait_steps(2)
    assert run.pid(role) != pid
    ROWS.append(
        {
            "component": component,
            "fault": "kill -9",
            "named_s": round(took, 1),
            "named_by": "orchestrator",
            "line": (line or "-").split("] ", 1)[-1][:220],
            "outcome": "replaced like a dead one (its rollouts errored, counted); run goes on",
            **seen.cells(),
        }
    )


def frozen_env_worker_replaced(run: Run) -> None:
    """An env worker stopped past 2x the bound: its env server kills it and starts another, as for a
    dead one; the rollouts it held are errored (counted), the run goes on."""
    pid = run.pid("env-worker")
    server_log = run.paths.env_server_dir("train", "reverse-text") / "server.log"
    os.kill(pid, signal.SIGSTOP)
    seen = Watch(run.console, run.paths.root, [[f"(pid {pid}) frozen"]], [[f"(pid {pid}) frozen"]])
    t0 = seen.t0
    _until(
        lambda: (seen.poll(), f"(pid {pid}) frozen (process stopped)" in server_log.read_text())[1],
        2 * BOUND + 60,
        "the env server replacing its frozen worker",
    )
    took = time.monotonic() - t0
    _until(seen.poll, 2 * BOUND + 60 - took, "the console and `hpcrl status` naming the frozen worker")
    line = next(x for x in server_log.read_text().splitlines() if f"(pid {pid}) frozen" in x)
    run.wait_steps(2)
    assert run.pid("env-worker") != pid
    ROWS.append(
        {
            "component": "env worker",
            "fault": f"SIGSTOP past 2x the bound ({2 * BOUND:.0f} s)",
            "named_s": round(took, 1),
            "named_by": "env server",
            "line": line.split("] ", 1)[-1][:220],
            "outcome": "killed, replaced like a dead one (its rollouts errored, counted); run goes on",
            **seen.cells(),
        }
    )


def frozen_env_server_restarted(run: Run) -> None:
    """An env server stopped past 2x the bound answers no ping: the orchestrator kills it and starts
    it again as it does a crashed one; the run goes on."""
    pid, mark = run.pid("env-server"), len(run.log("orchestrator"))
    os.kill(pid, signal.SIGSTOP)
    seen = Watch(run.console, run.paths.root, *stall_names("env-server", pid))
    t0 = seen.t0
    _until(
        lambda: (seen.poll(), "answered no ping" in run.log("orchestrator")[mark:])[1],
        2 * BOUND + 60,
        "the frozen server named",
    )
    took = time.monotonic() - t0
    # `hpcrl status` names it under "recent warnings" (the orchestrator's line), not only through the
    # errored rollouts' cause: under load the rollouts it held can be done or cancelled already.
    _until(seen.poll, 2 * BOUND + 60 - took, "the console and `hpcrl status` naming the frozen env server")
    seen.named(2 * BOUND + 60)
    _until(lambda: "restarted (restart 1)" in run.log("orchestrator")[mark:], 120, "the env server restarted")
    line = next(x for x in run.log("orchestrator")[mark:].splitlines() if "answered no ping" in x)
    run.wait_steps(2)
    assert run.pid("env-server") != pid
    ROWS.append(
        {
            "component": "env server",
            "fault": f"SIGSTOP past 2x the bound ({2 * BOUND:.0f} s)",
            "named_s": round(took, 1),
            "named_by": "orchestrator",
            "line": line.split("] ", 1)[-1][:220],
            "outcome": "killed, restarted like a crashed one (its rollouts errored, counted); run goes on",
            **seen.cells(),
        }
    )


def faults_of_run_1(run: Run, out: Path, no_tmpfs: str | None, quota: dict | None, disk: Path) -> None:
    """Every freeze in turn, the bus directory unwritable, full, read-only, over quota; the env's and
    the inference server's logs refused (faults_logs); kill -9 of the orchestrator ends the run."""
    try:
        _until(lambda: run.steps() >= 3, 240, "three published batches")
        freeze(run, "inference server", "inference", "orchestrator", ["inference server 0"], past=False)
        freeze(
            run,
            "inference server",
            "inference",
            "orchestrator",
            ["to inference server 0", "unanswered for", "/health unanswered"],
            past=True,
        )
        freeze(
            run,
            "trainer",
            "trainer",
            "orchestrator",
            ["waiting on policy", "trainer_0 unresponsive"],
            past=True,
        )
        freeze(
            run,
            "orchestrator",
            "orchestrator",
            "trainer",
            ["waiting on batch", "orchestrator unresponsive"],
            past=True,
        )
        freeze(
            run,
            "env worker",
            "env-worker",
            "orchestrator",
            ["env reverse-text worker 0 (pid {pid})", "in env code"],
            past=True,
        )
        frozen_env_worker_replaced(run)
        frozen_env_server_restarted(run)
        # Every other component frozen briefly (under the bound): not a stall, the run goes on.
        for component, role, namer in (
            ("trainer", "trainer", "orchestrator"),
            ("orchestrator", "orchestrator", "trainer"),
            ("env worker", "env-worker", "orchestrator"),
            ("env server", "env-server", "orchestrator"),
        ):
            freeze(run, component, role, namer, [], past=False)
        # kill -9 of each component the run survives: named, replaced, the run goes on.
        killed(
            run,
            "env worker",
            "env-worker",
            ["env worker 0 (pid {pid}) died", "signal 9"],
            status=[["(pid {pid}) died"]],
        )
        killed(
            run,
            "env server",
            "env-server",
            ["env server for train env 'reverse-text' died", "(it was pid {pid})"],
            status=[["died", "(it was pid {pid})"]],
        )
        killed(
            run,
            "inference server",
            "inference",
            ["inference server 0", "is down"],
            "is back (pid",
            status=[
                ["inference server 0", ": down"],
                ["inference server 0", "unresponsive"],
                ["inference server 0", "is down"],
            ],
        )
        # The bus directory unwritable for a while, then its disk full: the writer names the path
        # and the cause at once, retries, and the batch is written once it clears.
        rollouts, undo = run.paths.rollouts_dir, []
        hold = BOUND + 3
        how = "chattr +i" if os.geteuid() == 0 else "chmod 0555"
        bus = {"component": "bus (orchestrator writing rollouts/)", "outcome": RETRIED}
        refused(
            run,
            "orchestrator",
            {**bus, "fault": f"rollouts/ unwritable ({how}) for {hold:.0f} s"},
            lambda: undo.append(_make_unwritable(rollouts)[1]),
            lambda: subprocess.run(undo[-1], check=True),
            ["not writable", str(rollouts)],
            hold,
            BOUND + 60,
        )
        if no_tmpfs is None:
            filler: list[Filler] = []
            refused(
                run,
                "orchestrator",
                {**bus, "fault": f"disk full (rollouts/ a 64 MB tmpfs, filled) for {hold:.0f} s"},
                lambda: filler.append(Filler(rollouts)),
                lambda: filler[-1].stop(),
                ["disk full at", str(rollouts)],
                hold,
                BOUND + 60,
            )
            faults_logs.rollouts_read_only(run, hold, BOUND + 60)  # its tmpfs remounted ro: EROFS
        else:
            for fault in ("disk full", "read-only"):
                ROWS.append(_not_run("bus (orchestrator writing rollouts/)", fault, no_tmpfs))
        if quota is not None:  # the user's quota exhausted (EDQUOT): the bus, then the env's logs
            quota_refused(
                run, "orchestrator", bus, quota, rollouts, "cannot write rollouts", hold, BOUND + 60
            )
        faults_logs.logs_refused(run, hold, quota, no_tmpfs, disk)  # the env's and the server's logs
        # An inference server frozen past server_down_timeout_s: killed, restarted, brought back.
        pid, mark = run.pid("inference"), len(run.log("orchestrator"))
        os.kill(pid, signal.SIGSTOP)
        seen = Watch(run.console, run.paths.root, *stall_names("inference", pid))
        t0 = seen.t0
        _until(
            lambda: (seen.poll(), "is back (pid" in run.log("orchestrator")[mark:])[1],
            DOWN_S + 120,
            "the frozen server replaced",
        )
        took = time.monotonic() - t0
        seen.named(DOWN_S + 120)
        run.wait_steps(2)
        ROWS.append(
            {
                "component": "inference server",
                "fault": f"SIGSTOP past server_down_timeout_s ({DOWN_S:.0f} s)",
                "named_s": round(took, 1),
                "named_by": "orchestrator",
                "line": "killed (SIGKILL), restarted by the launcher, policy loaded and verified",
                "outcome": "run goes on",
                **seen.cells(),
            }
        )
        # kill -9 of the orchestrator: the run ends with one line naming it.
        _until(lambda: checkpoint.latest_complete(run.paths) is not None, 120, "a checkpoint")
        os.kill(run.pid("orchestrator"), signal.SIGKILL)
        seen = ended_watch(run, "orchestrator was killed by signal 9")
        _, stderr = run.communicate(timeout=120)
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
    assert run.proc.returncode != 0
    last = (stderr.strip().splitlines() or ["-"])[-1]
    assert "orchestrator was killed by signal 9" in last, last
    ROWS.append(
        {
            "component": "orchestrator",
            "fault": "kill -9",
            "named_s": 0,
            "named_by": "launcher",
            "line": last[:220],
            "outcome": "run ends (exit 1); resume continues",
            **seen.cells(),
        }
    )


BROKEN_ENVS = {
    "every reward raises": (
        'id = "tests.integration.faulty_env"\nname = "faulty"\nargs = {do = "raise", num_examples = 16}\n',
        ["env faulty: every rollout fails", "reward function raised on purpose"],
    ),
    "env cannot import": (
        'id = "tests.integration.no_such_env_module"\n',
        ["no_such_env_module"],
    ),
}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", sorted(BROKEN_ENVS))
def test_broken_env_ends_the_run_naming_env_and_cause(tmp_path: Path, case: str) -> None:
    table, expected = BROKEN_ENVS[case]
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(
        rl_toml(20, seq_len=64, max_tokens=8, top=f"stall_warning_s = {BOUND}\n").replace(
            'id = "reverse-text"\n', table
        )
    )
    out = tmp_path / "run"
    t0 = time.monotonic()
    res = subprocess.run(
        _hpcrl("run", str(cfg), "--output-dir", str(out)),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=500,
    )
    took = time.monotonic() - t0
    assert res.returncode != 0, res.stdout[-2000:]
    last = (res.stderr.strip() or res.stdout.strip()).splitlines()[-1]
    assert all(e in last for e in expected), last
    status = status_text(out)  # `ended:` once the launcher ran (not for a config it refused)
    assert ("every rollout" not in last and "ended:" not in status) or all(e in status for e in expected), (
        status
    )
    ROWS.append(
        {
            "component": "env",
            "fault": case,
            "named_s": round(took, 1),
            "named_by": "orchestrator" if "every rollout" in last else "start-up",
            "line": last[:260],
            "outcome": f"run ends (exit {res.returncode})",
            "data": "- (no step trained: nothing to resume)",
            **ended_cells(
                took, status, "the config refused before a run directory: `hpcrl status` has no run"
            ),
        }
    )
    _write_table()


VF1_TOOLS_UNDER_DEFAULT = """max_steps = 20
seq_len = 1024
stall_warning_s = 6.0
[model]
name = "hpcrl/tiny-qwen3-think"
[orchestrator]
batch_size = 8
rollouts_per_example = 4
[orchestrator.renderer]
name = "default"
[orchestrator.train.sampling]
max_tokens = 16
[[orchestrator.train.env]]
id = "vf1_tool_env"
workers = 2
args = { num_tasks = 4 }
"""


@pytest.mark.slow
@pytest.mark.waits
@pytest.mark.timeout(600)
def test_tool_env_under_the_default_renderer_ends_naming_env_cause_and_fix(tmp_path: Path) -> None:
    """The issue's must-show run: a verifiers 0.4 tool-calling env (its tools appear only at
    runtime, in the harness program's requests: no start-up check can see them) with the `default`
    renderer. Every model call fails in verifiers' interception server; the run ends within a few
    minutes, its last line naming the env, the cause and the fix."""
    from hpcrl.envs.verifiers.versions import installed, major_minor

    if (major_minor(installed()) or (0, 0)) < (0, 4):
        pytest.skip("needs verifiers 0.4")
    root = Path(__file__).resolve().parents[2]
    cfg, out = tmp_path / "cfg.toml", tmp_path / "run"
    cfg.write_text(VF1_TOOLS_UNDER_DEFAULT)
    t0 = time.monotonic()
    res = subprocess.run(
        _hpcrl("run", str(cfg), "--output-dir", str(out)),
        env={**_env(), "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests' / 'vf1_envs'}"},
        capture_output=True,
        text=True,
        timeout=500,
    )
    took = time.monotonic() - t0
    assert res.returncode != 0, res.stdout[-2000:]
    last = (res.stderr.strip() or res.stdout.strip()).splitlines()[-1]
    for part in ("env vf1_tool_env", "DefaultRenderer does not support tools", 'renderer.name = "qwen3"'):
        assert part in last, last
    assert took < 300, f"took {took:.0f} s to end"
    status = status_text(out)
    assert "ended:" in status and "env vf1_tool_env" in status, status
    ROWS.append(
        {
            "component": "env (verifiers 0.4, tools at runtime)",
            "fault": 'tool env under renderer "default"',
            "named_s": round(took, 1),
            "named_by": "orchestrator",
            "line": f"{last[:200]} … {last[-160:]}",  # the end holds the fix
            "outcome": f"run ends (exit {res.returncode})",
            "data": "- (no step trained: nothing to resume)",
            **ended_cells(took, status, ""),
        }
    )
    _write_table()
