"""A failed online eval during `hpcrl sft` ends the run, as prime-rl's launcher does when its evals
process dies (hpcrl.trainer.sft_eval's docstring): exit 1, one ERROR line last naming the eval env and
the cause, eval/<env>/failed in metrics.jsonl, and the checkpoint written on the way out intact."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hpcrl import checkpoint
from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths
from hpcrl.trainer.sft_eval import failure_cause
from tests.conftest import child_env

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 300  # tiny steps: the step-0 eval fails (in ~2 s) long before the last one

# tests.integration.faulty_env's load_environment iterates `dos`: an int makes it raise at load (a
# TypeError inside the env's own code), so `hpcrl eval` fails before its inference server starts.
BROKEN_EVAL = """
[eval]
interval = 1000
num_examples = 2
[[eval.env]]
id = "tests.integration.faulty_env"
name = "faulty"
args = {dos = 5}
"""


def test_failure_cause_names_the_env_and_the_error_line():
    out = (
        "01:53:35 INFO    [eval] env server eval/faulty started (pid 9712, 1 workers)\n"
        "config error: env[1]: environment 'tests.integration.faulty_env': 'int' object is not iterable\n"
    )
    assert failure_cause(out, ["rt", "faulty"]) == (
        "config error: eval.env[1] (faulty): environment 'tests.integration.faulty_env': 'int' object is "
        "not iterable"
    )
    tb = 'Traceback (most recent call last):\n  File "x.py", line 1\nRuntimeError: server died\n\n'
    assert failure_cause(tb + "some trailing noise\n", ["rt"]) == "RuntimeError: server died"
    assert failure_cause("", ["rt"]) == "no output"
    assert failure_cause("just a last line\n", ["rt"]) == "just a last line"


def test_sft_with_a_failing_eval_env_exits_1_and_keeps_its_checkpoint(tiny_model_dir: Path, tmp_path: Path):
    from hpcrl.trainer.sft_data import make_demo

    data, _ = make_demo(tmp_path / "data" / "train.jsonl", "reverse-text", n=40, seed=0)
    out = tmp_path / "run"
    cfg = tmp_path / "sft.toml"
    cfg.write_text(
        f'max_steps = {MAX_STEPS}\nseq_len = 64\noutput_dir = "{out}"\n[model]\nname = "{tiny_model_dir}"\n'
        f'[data]\nname = "{data}"\nbatch_size = 4\n[optim]\nlr = 1e-3\n[ckpt]\ninterval = 1000\n'
        + BROKEN_EVAL
    )
    env = child_env(OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "sft", "@", str(cfg)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 1, output[-3000:]
    paths = RunPaths(out)
    last = proc.stderr.strip().splitlines()[-1]  # the run's last line says why it failed
    assert "ERROR" in last, output[-3000:]
    assert "online eval of step 0 (faulty) failed (exit 2)" in last, output[-3000:]
    assert "eval.env[0] (faulty)" in last and "'int' object is not iterable" in last
    assert str(paths.online_eval_dir(0) / "eval.out") in last
    evals = [r for r in read_metrics(paths.metrics_file) if r.get("role") == "eval"]
    assert [(r["step"], r["eval/faulty/failed"], r["eval/failed"]) for r in evals] == [(0, 1.0, 1.0)]
    # it stopped early as a stop request does: the checkpoint of the step it ended at is complete
    step = checkpoint.latest_complete(paths)
    assert step is not None and 1 <= step < MAX_STEPS, output[-3000:]
    assert "an online eval failed: " in output
    assert checkpoint.verify(paths, step) is None
    trained = [r["step"] for r in read_metrics(paths.metrics_file) if r.get("role") == "trainer"]
    assert max(trained) == step
