"""prime-rl's SFT [eval] (configs/basic/reverse-text/sft.toml's shape) through `hpcrl sft`: online
evaluations of the policy on an env at step 0, every interval and at the last step, each scored by
`hpcrl eval` on the weights of that step, its avg@k / pass@k in metrics.jsonl at that step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpcrl.config import schema
from hpcrl.errors import ConfigError
from hpcrl.launch.checks import load
from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths
from hpcrl.trainer.sft_eval import due_steps, summary_metrics
from tests.integration.test_sft import run_sft

PRIME_EVAL = """
[eval]
interval = {interval}
num_examples = 2
{extra}
[eval.sampling]
max_completion_tokens = 8

[[eval.source]]
name = "reverse-text"

[eval.source.env.taskset]
id = "reverse-text"

[eval.source.env.agent.harness]
id = "null"

[eval.source.env.agent.runtime]
type = "subprocess"

[inference]
"""


def test_due_steps():
    assert due_steps(25, 100, 0, True, False) == {0, 25, 50, 75, 100}
    assert due_steps(25, 90, 0, False, False) == {25, 50, 75, 90}  # skip_first_step; the last step too
    assert due_steps(25, 100, 50, True, False) == {75, 100}  # a resume: not the resumed step again
    assert due_steps(25, 100, 50, True, True) == {50, 75, 100}  # retrigger_on_resume


def test_summary_metrics_are_the_orchestrators_names():
    s = {"envs": {"rt": {"rollouts_per_example": 2, "avg@2": 0.5, "pass@2": 1.0, "errored": 0}}}
    assert summary_metrics(s) == {"eval/rt/avg@2": 0.5, "eval/rt/pass@2": 1.0, "eval/rt/errored": 0.0}


def _config(tmp_path: Path, model: Path, data: Path, out: Path, interval: int = 2, extra: str = "") -> Path:
    cfg = tmp_path / "sft.toml"
    cfg.write_text(
        f'max_steps = 3\nseq_len = 64\noutput_dir = "{out}"\n'
        f'[model]\nname = "{model}"\n[data]\nname = "{data}"\nbatch_size = 4\n[optim]\nlr = 1e-3\n'
        + PRIME_EVAL.format(interval=interval, extra=extra)
    )
    return cfg


def test_prime_rl_sft_eval_is_read(tmp_path: Path):
    cfg = _config(
        tmp_path, Path("hpcrl/tiny-qwen3"), tmp_path / "d.jsonl", tmp_path / "run", extra="group_size = 2"
    )
    c = load(["@", str(cfg)], schema.SFTConfig).config
    assert c.eval.interval == 2 and c.eval.num_examples == 2 and c.eval.rollouts_per_example == 2
    assert c.eval.sampling.max_tokens == 8 and [e.name for e in c.eval.env] == ["reverse-text"]
    bad = tmp_path / "bad.toml"
    bad.write_text(cfg.read_text().replace("[eval]\n", "[eval]\nclient = {base_url = 'http://x'}\n"))
    with pytest.raises(ConfigError, match="eval.client"):
        load(["@", str(bad)], schema.SFTConfig)
    # prime-rl's top-level [inference] is the evals' server: checked at load as `hpcrl eval` reads it
    bad.write_text(cfg.read_text().replace("[inference]\n", "[inference]\nmax_batch_size = 0\n"))
    with pytest.raises(ConfigError, match="eval"):
        load(["@", str(bad)], schema.SFTConfig)
    bad.write_text(cfg.read_text()[: cfg.read_text().index("[eval]")] + "[inference]\n")
    with pytest.raises(ConfigError, match="only used for online evals"):
        load(["@", str(bad)], schema.SFTConfig)


def test_sft_evaluates_online(tiny_model_dir: Path, tmp_path: Path):
    from hpcrl.trainer.sft_data import make_demo

    data, _ = make_demo(tmp_path / "data" / "train.jsonl", "reverse-text", n=40, seed=0)
    out = tmp_path / "run"
    run_sft(str(_config(tmp_path, tiny_model_dir, data, out, extra="seq_len = 256")), timeout=600)
    evals = {r["step"]: r for r in read_metrics(RunPaths(out).metrics_file) if r.get("role") == "eval"}
    assert sorted(evals) == [0, 2, 3]  # the starting weights, interval 2, the last step
    for step, r in evals.items():
        assert 0.0 <= r["eval/reverse-text/avg@1"] <= 1.0 and r["eval/reverse-text/errored"] == 0.0
        summary = json.loads((RunPaths(out).online_eval_dir(step) / "summary.json").read_text())
        assert summary["model"] == str(RunPaths(out).online_eval_dir(step) / "weights")
        assert summary["envs"]["reverse-text"]["num_examples"] == 2
    trainer = [r for r in read_metrics(RunPaths(out).metrics_file) if r.get("role") == "trainer"]
    assert sorted(r["step"] for r in trainer) == [1, 2, 3]


def test_eval_server_takes_the_gpus_after_the_trainers():
    from hpcrl.trainer.sft_eval import eval_devices

    assert eval_devices([], 1, 1) is None  # CPU
    assert eval_devices(["0", "1"], 1, 1) == ["1"]  # prime-rl: num_train_gpus = 1, num_infer_gpus = 1
    assert eval_devices(["4", "5", "6", "7"], 2, 2) == ["6", "7"]
    assert eval_devices(["0"], 1, None) is None  # none left: shares the trainer's
