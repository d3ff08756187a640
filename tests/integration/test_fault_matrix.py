"""The fault matrix (issue 40): components x faults on one real `hpcrl run`, each fault named within
its bound, the run surviving what it can, and `hpcrl resume --step -1` continuing without a prompt
skipped or repeated.

The cases share runs (a run per case would cost minutes each on 2 cores): run 1 goes through every
freeze in turn (SIGSTOP shorter than the stall bound, SIGSTOP past it, SIGSTOP of an inference server
past server_down_timeout_s) and kill -9 of the processes that are restarted (inference server, env
worker, env server), then kill -9 of the orchestrator ends it; `hpcrl resume --step -1` continues
(run 2), where kill -9 of the trainer ends it; the last resume reaches max_steps with exit 0.
A second group of cases is one short run each: an env whose every reward raises, an env that cannot
import.

`HPCRL_FAULT_TABLE=docs/fault_matrix.md python -m pytest -m slow tests/integration/test_fault_matrix.py`
rewrites the table in docs (scripts/fault_matrix.sh).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpcrl.paths import RunPaths
from tests.conftest import rl_toml

BOUND = 6.0  # stall_warning_s of these runs (the default is 60 s)
DOWN_S = 25.0  # orchestrator.server_down_timeout_s
MAX_STEPS = 100000  # run 1 and 2 end by kill -9; the last resume sets its own max_steps
CONFIG = rl_toml(
    "{steps}",
    seq_len=64,
    max_tokens=8,
    top=f"stall_warning_s = {BOUND}\n",
    orchestrator=f"server_down_timeout_s = {DOWN_S}\n",
    tables="[ckpt]\ninterval = 5\n",
)
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


def freeze(run: Run, component: str, role: str, namer: str, names: list[str], *, past: bool) -> None:
    """SIGSTOP `role`'s process; past the bound: until `namer`'s log names it (all of `names`), the
    time measured from the SIGSTOP; briefly: half the bound, and nothing may be named."""
    pid = run.pid(role)
    mark = len(run.log(namer))
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        if past:

            def named() -> bool:
                new = _new_lines(run.log(namer), mark)
                return any(
                    "no progress for" in line and all(n in line for n in names) for line in new.splitlines()
                )

            took = _until(named, BOUND + 30, f"{namer} naming the frozen {component}")
            status = _status(run.paths.root)
            assert "stalled" in status or "unresponsive" in status, status
        else:
            time.sleep(BOUND / 2)
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
        }
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_fault_matrix_one_run_and_its_resumes(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(CONFIG.format(steps=MAX_STEPS))
    out = tmp_path / "run"
    run = _start(out, "run", str(cfg), "--output-dir", str(out))
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
        freeze(run, "env worker", "env-worker", "orchestrator", ["rollouts of ['reverse-text']"], past=True)
        # The env server runs no rollout code (its workers do): frozen, it stalls nothing.
        pid = run.pid("env-server")
        os.kill(pid, signal.SIGSTOP)
        try:
            run.wait_steps(3)
        finally:
            os.kill(pid, signal.SIGCONT)
        ROWS.append(
            {
                "component": "env server",
                "fault": "SIGSTOP past the bound",
                "named_s": None,
                "named_by": "- (not a stall)",
                "line": "it runs no rollout code: 3 steps published while it was frozen",
                "outcome": "run goes on",
            }
        )
        # An inference server frozen past server_down_timeout_s: killed, restarted, brought back.
        pid, mark = run.pid("inference"), len(run.log("orchestrator"))
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        _until(
            lambda: "is back (pid" in run.log("orchestrator")[mark:],
            DOWN_S + 120,
            "the frozen server replaced",
        )
        took = time.monotonic() - t0
        run.wait_steps(2)
        ROWS.append(
            {
                "component": "inference server",
                "fault": f"SIGSTOP past server_down_timeout_s ({DOWN_S:.0f} s)",
                "named_s": round(took, 1),
                "named_by": "orchestrator",
                "line": "killed (SIGKILL), restarted by the launcher, policy loaded and verified",
                "outcome": "run goes on",
            }
        )
        # kill -9 of the orchestrator: the run ends with one line naming it.
        _until(lambda: (run.paths.checkpoint_dir(5) / "COMPLETE").exists(), 120, "a checkpoint")
        os.kill(run.pid("orchestrator"), signal.SIGKILL)
        stdout, stderr = run.proc.communicate(timeout=120)
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
        }
    )
    stopped_at = run.steps()
    final = stopped_at + 6
    res = subprocess.run(
        _hpcrl("resume", "--step", "-1", "--output-dir", str(out), "--max-steps", str(final)),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    prompts = [json.loads(x) for x in RunPaths(out).prompts_log.read_text().splitlines()]
    steps = [p["step"] for p in prompts]
    assert steps == list(range(1, final + 1)), steps
    ids = [i for p in prompts for i in p["example_ids"]]
    assert len(ids) == len(set(ids)), "a prompt was trained on twice"
    ROWS[-1]["data"] = f"resume: steps 1..{final} each once, {len(ids)} prompts, none repeated"
    _write_table()


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
    ROWS.append(
        {
            "component": "env",
            "fault": case,
            "named_s": round(took, 1),
            "named_by": "orchestrator" if "every rollout" in last else "start-up",
            "line": last[:260],
            "outcome": f"run ends (exit {res.returncode})",
        }
    )
    _write_table()
