"""Issue 51 on a real `hpcrl run`: every rollout saved (train each step, eval where eval ran), the
rubric metrics, and the roles' WARNING lines on the run's console: an inference server frozen
(SIGSTOP) past the stall bound is named there, and so is its recovery after SIGCONT."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from hpcrl.monitor import rollout_files as rf
from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths
from tests.integration.faults import _hpcrl
from tests.integration.tiny_run import TINY_RL

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_run_saves_every_rollout(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        _hpcrl(
            "run", str(REPO / "configs" / "demo" / "rl.toml"), "--output-dir", str(out), "--max-steps", "3",
            "--orchestrator.batch-size", "32", "--orchestrator.eval.num-examples", "8", "--no-log.plots",
        ),
        capture_output=True, text=True, timeout=280, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert f"hpcrl dashboard {out}" in proc.stdout and "ssh -N -L" in proc.stdout
    assert rf.steps(out) == [0, 1, 2, 3]
    assert rf.splits(out, 0) == ["eval"] and rf.splits(out, 3) == ["train", "eval"]
    for step in (1, 2, 3):
        recs = list(rf.iter_records(out, step, "train"))
        trained = [r for r in recs if r["trained"]]
        assert len(trained) == 32 and len(rf.index(out, step, "train")) == len(recs)
        r = trained[0]
        assert r["step"] == step and r["env"]["name"] == "reverse-text-demo"
        assert r["messages"][-1]["role"] == "assistant" and r["num_prompt_messages"] >= 1
        assert set(r["rewards"]) == {"reverse_similarity", "exact_match"}
        assert r["advantage"] is not None and r["timing"]["duration"] > 0
        turn = r["traces"][0]["turns"][0]
        assert (
            len(turn["completion_ids"])
            == len(turn["logprobs"])
            == len(turn["tokens"])
            == r["num_output_tokens"]
        )
    evals = list(rf.iter_records(out, 3, "eval"))
    assert len(evals) == 8 * 2 and all(e["split"] == "eval" and e["trained"] is False for e in evals)
    # the rubric as metrics: the weighted function, and the weight-0 one as a plain metric
    recs = [
        m
        for m in read_metrics(out / "metrics.jsonl")
        if m.get("role") == "orchestrator" and "batch/samples" in m
    ]
    assert len(recs) == 3
    for m in recs:
        assert m["reward/reverse-text-demo/reverse_similarity/mean"] == pytest.approx(
            m["reward/reverse-text-demo/mean"]
        )
        assert "metric/reverse-text-demo/exact_match/mean" in m
    status = subprocess.run(_hpcrl("status", str(out)), capture_output=True, text=True, timeout=60).stdout
    assert "rollouts:     4 step(s) saved, 0..3" in status and "hpcrl dashboard" in status


class Console:
    """A run's stdout, read line by line by a thread (what a person sees)."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, *texts: str, timeout: float, after: int = 0) -> int:
        """The index of the first line from `after` on that holds every one of `texts`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, line in enumerate(self.lines[after:], after):
                if all(t in line for t in texts):
                    return i
            time.sleep(0.2)
        raise AssertionError(f"the console never printed {texts!r}:\n" + "\n".join(self.lines[-40:]))


@pytest.mark.slow
@pytest.mark.waits  # a freeze past the stall bound
@pytest.mark.timeout(240)
def test_a_frozen_server_and_its_recovery_are_on_the_console(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(TINY_RL.format(steps=100000).replace("[log]\n", "stall_warning_s = 4.0\n[log]\n", 1))
    out = tmp_path / "run"
    proc = subprocess.Popen(
        _hpcrl("run", str(cfg), "--output-dir", str(out)),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    console, pid = Console(proc), None
    try:
        mark = console.wait_for("step    2/", timeout=150)
        pid = json.loads(RunPaths(out).server_file(0).read_text())["pid"]
        os.kill(pid, signal.SIGSTOP)
        frozen = time.monotonic()
        stall = console.wait_for(
            "WARNING [orchestrator]", "no progress for", "inference server 0", timeout=40, after=mark
        )
        named_s = time.monotonic() - frozen
        os.kill(pid, signal.SIGCONT)
        back = console.wait_for("WARNING [orchestrator]", "moving again", timeout=40, after=stall)
        console.wait_for("step ", timeout=40, after=back)  # and the step lines go on
        print(
            f"stall named on the console {named_s:.1f} s after SIGSTOP:\n" + "\n".join(console.lines[mark:])
        )
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    # `hpcrl logs --warnings` shows the same from the files (a SLURM job's view)
    logs = subprocess.run(_hpcrl("logs", str(out), "--warnings"), capture_output=True, text=True, timeout=60)
    assert logs.returncode == 0 and "no progress for" in logs.stdout and "moving again" in logs.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_resumed_run_rewrites_its_steps_whole(tmp_path: Path) -> None:
    """Resume from checkpoint 2 of a finished 4-step run: the batches published after it (pending in
    the checkpoint) keep their saved rollouts, the steps generated again are written again whole;
    every step holds exactly one batch of trained rollouts, none twice."""
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(TINY_RL.format(steps=4) + "[ckpt]\ninterval = 2\n")
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.run(
        _hpcrl("run", str(cfg), "--output-dir", str(out)), capture_output=True, text=True, env=env
    )
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    before = {s: [r["id"] for r in rf.iter_records(out, s, "train")] for s in (1, 2, 3, 4)}
    state = json.loads((RunPaths(out).orchestrator_ckpt_dir(2) / "state.json").read_text())
    again = subprocess.run(
        _hpcrl("resume", "--step", "2", "--output-dir", str(out), "--max-steps", "4"),
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    for s in (1, 2, 3, 4):
        ids = [r["id"] for r in rf.iter_records(out, s, "train")]
        trained = [r for r in rf.iter_records(out, s, "train") if r["trained"]]
        assert len(trained) == 16 and len(ids) == len(set(ids)), (s, ids)
        assert len(rf.index(out, s, "train")) == len(ids)
        if s <= state["step"]:  # published before the checkpoint's boundary: kept as they were
            assert ids == before[s]
    assert not list((out / "rollouts").rglob("*.tmp-*"))
