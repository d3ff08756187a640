"""Every user error is one line on stderr naming the dotted field path, exit code 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.cli import main
from tests.conftest import rl_toml

REPO = Path(__file__).resolve().parents[2]

BASE = rl_toml()
NO_ENV = BASE.split("[[orchestrator.train.env]]")[0]
HOSTED = """model = "Qwen/Qwen3-4B"
max_steps = 10
batch_size = 16
rollouts_per_example = 4
[sampling]
max_tokens = 64
[[env]]
id = "primeintellect/reverse-text"
"""

# (id, config text, flags, exact dotted path, fragment of the message)
CASES: list[tuple[str, str, list[str], str, str]] = [
    # TOML syntax: the path is the file, the message has the line
    (
        "toml-syntax",
        BASE + "[trainer]\nseed = = 3\n",
        [],
        "{file}",
        "invalid TOML: Invalid value (at line 15",
    ),
    ("toml-duplicate-key", "max_steps = 6\n" + BASE, [], "{file}", "line 2"),
    # wrong types
    (
        "type-flag",
        BASE,
        ["--orchestrator.batch-size", "abc"],
        "orchestrator.batch_size",
        "expected int, got str ('abc' given)",
    ),
    ("type-file", BASE.replace("seq_len = 128", 'seq_len = "long"'), [], "seq_len", "expected int, got str"),
    (
        "type-list-item",
        BASE,
        ["--trainer.optim.betas", '["a", 0.9]'],
        "trainer.optim.betas[0]",
        "expected float",
    ),
    (
        "type-env-args",
        BASE.replace('id = "reverse-text"', 'id = "reverse-text"\nargs = 3'),
        [],
        "orchestrator.train.env[0].args",
        "expected table, got int",
    ),
    ("type-section-flag", BASE, ["--orchestrator", "5"], "orchestrator", "is a section"),
    ("type-section-value", BASE, ["--wandb=3"], "wandb", "is a section"),
    # unknown keys, with suggestions
    (
        "unknown-top",
        "max_stepz = 3\n" + BASE,
        [],
        "max_stepz",
        "unknown field in top level (did you mean 'max_steps'?)",
    ),
    (
        "unknown-nested",
        BASE + "[trainer.optim]\nlrr = 1e-5\n",
        [],
        "trainer.optim.lrr",
        "unknown field in trainer.optim (did you mean 'lr'?)",
    ),
    (
        "unknown-in-list",
        BASE.replace('id = "reverse-text"', 'id = "reverse-text"\nnme = "x"'),
        [],
        "orchestrator.train.env[0].nme",
        "(did you mean 'name'?)",
    ),
    (
        "unknown-flag",
        BASE,
        ["--orchestrator.batch-sze", "8"],
        "orchestrator.batch_sze",
        "(did you mean 'batch_size'?)",
    ),
    ("unknown-flag-top", BASE, ["--max-step", "8"], "max_step", "(did you mean 'max_steps'?)"),
    ("unknown-flag-under-leaf", BASE, ["--max-steps.x", "8"], "max_steps", "has no field 'x'"),
    # out of range
    (
        "range-batch",
        BASE,
        ["--orchestrator.batch-size", "0"],
        "orchestrator.batch_size",
        "expected int >= 1, got 0",
    ),
    ("range-port", BASE, ["--server.port", "70000"], "server.port", "expected int <= 65535, got 70000"),
    ("range-dropout", BASE, ["--model.lora.dropout", "2"], "model.lora.dropout", "<= 1.0"),
    ("range-lr", BASE, ["--trainer.optim.lr=-1"], "trainer.optim.lr", "expected float >= 0.0, got -1"),
    ("range-max-steps", BASE.replace("max_steps = 5", "max_steps = -3"), [], "max_steps", ">= 0"),
    (
        "range-top-p",
        BASE,
        ["--orchestrator.train.sampling.top-p", "0"],
        "orchestrator.train.sampling.top_p",
        "> 0.0",
    ),
    # bad literal values list what is allowed
    (
        "literal-flag",
        BASE,
        ["--orchestrator.training-mode", "ppo"],
        "orchestrator.training_mode",
        "invalid value 'ppo' (allowed: opd, rl, sft)",
    ),
    (
        "literal-file",
        BASE + '[trainer.optim]\nscheduler = "step"\n',
        [],
        "trainer.optim.scheduler",
        "(allowed: constant, cosine, linear)",
    ),
    (
        "literal-optional",
        BASE,
        ["--orchestrator.train.sampling.reasoning-effort", "max"],
        "orchestrator.train.sampling.reasoning_effort",
        "(allowed: high, low, medium)",
    ),
    # cross-field
    (
        "batch-not-multiple",
        BASE,
        ["--orchestrator.batch-size", "10"],
        "orchestrator.batch_size",
        "10 is not a multiple of orchestrator.rollouts_per_example (4)",
    ),
    (
        "max-tokens-over-seq-len",
        BASE,
        ["--orchestrator.train.sampling.max-tokens", "200"],
        "orchestrator.train.sampling.max_tokens",
        "200 is longer than seq_len (128)",
    ),
    (
        "eval-max-tokens",
        BASE + "[orchestrator.eval.sampling]\nmax_tokens = 500\n",
        [],
        "orchestrator.eval.sampling.max_tokens",
        "longer than seq_len (128)",
    ),
    (
        "gpus-exceed-node",
        BASE,
        ["--deployment.num-train-gpus", "6", "--deployment.num-infer-gpus", "4"],
        "deployment.num_train_gpus",
        "= 10 exceeds gpus_per_node (8)",
    ),
    (
        "gpus-zero",
        BASE,
        ["--deployment.num-train-gpus", "0", "--deployment.num-infer-gpus", "1"],
        "deployment.num_train_gpus",
        "at least 1",
    ),
    (
        "gpus-and-nodes",
        BASE,
        ["--deployment.num-train-gpus", "1", "--deployment.num-train-nodes", "2"],
        "deployment",
        "not both",
    ),
    ("nodes-half", BASE, ["--deployment.num-train-nodes", "2"], "deployment.num_infer_nodes", "set both"),
    (
        "slurm-nodes-sum",
        BASE + "[deployment]\nnum_train_nodes = 2\nnum_infer_nodes = 2\n[slurm]\nnodes = 3\n",
        [],
        "slurm.nodes",
        "3 != num_train_nodes + num_infer_nodes (4)",
    ),
    (
        "tp-divides-gpus",
        BASE,
        [
            "--deployment.num-train-gpus",
            "1",
            "--deployment.num-infer-gpus",
            "2",
            "--inference.parallel.tp",
            "3",
        ],
        "inference.parallel.tp",
        "does not divide num_infer_gpus (2)",
    ),
    (
        "env-ratios-length",
        BASE,
        ["--orchestrator.buffer.env-ratios", "[0.5, 0.5]"],
        "orchestrator.buffer.env_ratios",
        "has 2 entries but there are 1 training envs",
    ),
    (
        "env-ratios-and-ratio",
        BASE.replace('id = "reverse-text"', 'id = "reverse-text"\nratio = 1.0'),
        ["--orchestrator.buffer.env-ratios", "[1.0]"],
        "orchestrator.buffer.env_ratios",
        "not both",
    ),
    (
        "hard-over-easy",
        BASE,
        ["--orchestrator.buffer.hard-threshold", "0.9"],
        "orchestrator.buffer.hard_threshold",
        "0.9 is above easy_threshold (0.8)",
    ),
    (
        "shared-max-steps",
        BASE + "[trainer]\nmax_steps = 7\n",
        [],
        "trainer.max_steps",
        "7 conflicts with max_steps = 5",
    ),
    (
        "shared-model-name",
        BASE,
        ["--trainer.model.name", "other"],
        "trainer.model.name",
        "'other' conflicts with model.name = 'hpcrl/tiny-qwen3'",
    ),
    (
        "shared-seq-len",
        BASE + "[inference]\nseq_len = 64\n",
        [],
        "inference.seq_len",
        "conflicts with seq_len = 128",
    ),
    (
        "alias-conflict",
        BASE.replace("rollouts_per_example = 4", "rollouts_per_example = 4\ngroup_size = 8"),
        [],
        "orchestrator.group_size",
        "conflicts with orchestrator.rollouts_per_example",
    ),
    (
        "missing-env-id",
        BASE + "[[orchestrator.train.env]]\nargs = { split = 'train' }\n",
        [],
        "orchestrator.train.env[1].id",
        "required field is missing",
    ),
    ("no-envs", NO_ENV, [], "orchestrator.train.env", "at least one training environment is required"),
    (
        "duplicate-env-names",
        BASE + '[[orchestrator.train.env]]\nid = "primeintellect/reverse-text"\n',
        [],
        "orchestrator.train.env[1].name",
        "duplicate env name 'reverse-text'",
    ),
    (
        "duplicate-eval-names",
        BASE + '[[orchestrator.eval.env]]\nid = "arithmetic"\n[[orchestrator.eval.env]]\nid = "arithmetic"\n',
        [],
        "orchestrator.eval.env[1].name",
        "duplicate env name 'arithmetic'",
    ),
    (
        "empty-model",  # a missing one is prime-rl's default (tests/unit/test_prime_shapes.py)
        BASE.replace('[model]\nname = "hpcrl/tiny-qwen3"\n', '[model]\nname = " "\n'),
        [],
        "model.name",
        "is required",
    ),
    (
        "opd-without-teacher",
        BASE,
        ["--orchestrator.training-mode", "opd"],
        "orchestrator.teacher",
        "training_mode = 'opd' needs [orchestrator.teacher] base_url",
    ),
    (
        "teacher-in-rl",
        BASE + '[orchestrator.teacher]\nbase_url = "http://127.0.0.1:8001/v1"\n',
        [],
        "orchestrator.teacher",
        "only used with training_mode",
    ),
    (
        "off-policy-below-async",
        BASE,
        ["--orchestrator.max-async-level", "9"],
        "orchestrator.max_off_policy_steps",
        "8 < max_async_level (9)",
    ),
    (
        "micro-batch-below-seq-len",
        BASE,
        ["--trainer.micro-batch-tokens", "64"],
        "trainer.micro_batch_tokens",
        "64 must be at least seq_len (128)",
    ),
    ("betas", BASE, ["--trainer.optim.betas", "[0.9]"], "trainer.optim.betas", "not two numbers in [0, 1)"),
    (
        "ckpt-keep-interval",
        BASE,
        ["--ckpt.interval", "3", "--ckpt.keep-interval", "10"],
        "ckpt.keep_interval",
        "10 is not a multiple of ckpt.interval (3)",
    ),
    (
        "ckpt-resume-beyond",
        BASE,
        ["--ckpt.resume-step", "99"],
        "ckpt.resume_step",
        "99 is beyond max_steps (5)",
    ),
    (
        "adapter-without-lora",
        BASE,
        ["--ckpt.save-adapter-separately"],
        "ckpt.save_adapter_separately",
        "LoRA",
    ),
    ("slurm-time", BASE, ["--slurm.time", "25h"], "slurm.time", "'25h' is not a SLURM time (HH:MM:SS"),
    ("slurm-mem", BASE, ["--slurm.mem", "12X"], "slurm.mem", "not a SLURM memory size"),
    (
        "slurm-extra",
        BASE,
        ["--slurm.extra-sbatch", '["exclusive"]'],
        "slurm.extra_sbatch[0]",
        "long sbatch option",
    ),
    # flag syntax
    (
        "flag-no-value-end",
        BASE,
        ["--orchestrator.batch-size"],
        "orchestrator.batch_size",
        "flag needs a value (int)",
    ),
    (
        "flag-no-value-next-flag",
        BASE,
        ["--trainer.optim.lr", "--max-steps", "3"],
        "trainer.optim.lr",
        "needs a value",
    ),
    (
        "no-on-non-bool",
        BASE,
        ["--no-max-steps"],
        "max_steps",
        "--no- works only on booleans and optional sections",
    ),
    ("no-with-value", BASE, ["--no-wandb=true"], "wandb", "take no value"),
    ("bool-bad-value", BASE, ["--deterministic=yes"], "deterministic", "expected true or false, got 'yes'"),
    ("malformed-flag", BASE, ["--.x", "1"], "--.x", "malformed flag"),
    ("positional-not-toml", BASE, ["extra"], "extra", "unexpected argument"),
    ("missing-file", BASE, ["@", "does-not-exist.toml"], "does-not-exist.toml", "config file not found"),
    ("at-without-file", BASE, ["@"], "@", "expected a TOML file after '@'"),
    ("section-at-without-file", BASE, ["--trainer", "@"], "trainer", "expected a TOML file after '@'"),
    # hosted shape: the native path, plus the field as the user wrote it
    (
        "hosted-unknown-top",
        "learning_rat = 1e-4\n" + HOSTED,
        [],
        "learning_rat",
        "(did you mean 'learning_rate'?)",
    ),
    (
        "hosted-batch",
        HOSTED.replace("batch_size = 16", "batch_size = 10"),
        [],
        "orchestrator.batch_size",
        "[hosted field: batch_size]",
    ),
    (
        "hosted-sampling-unknown",
        HOSTED.replace("max_tokens = 64", "max_tokns = 64"),
        [],
        "orchestrator.train.sampling.max_tokns",
        "[hosted field: sampling.max_tokns]",
    ),
    (
        "hosted-env-not-table",
        HOSTED.split("[[env]]")[0].replace("[sampling]", 'env = "reverse-text"\n[sampling]'),
        [],
        "env",
        "expected an array of tables ([[env]])",
    ),
    (
        "hosted-checkpoints-unknown",
        HOSTED + "[checkpoints]\nintervl = 5\n",
        [],
        "checkpoints.intervl",
        "allowed: interval, keep_cloud",
    ),
    (
        "hosted-adapters-unknown",
        HOSTED + "[adapters]\nkeep = 5\n",
        [],
        "adapters.keep",
        "allowed: interval, keep_last",
    ),
    (
        "hosted-lr-conflict",
        "learning_rate = 1e-4\n" + HOSTED + "[trainer.optim]\nlr = 1e-5\n",
        [],
        "trainer.optim.lr",
        "conflicts with learning_rate",
    ),
    (
        "hosted-env-ratios",
        HOSTED + '[[env]]\nid = "arithmetic"\n[buffer]\nenv_ratios = [1.0]\n',
        [],
        "orchestrator.buffer.env_ratios",
        "[hosted field: buffer.env_ratios]",
    ),
]


@pytest.mark.parametrize(
    ("text", "flags", "path", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_config_is_one_line_exit_2(
    text: str,
    flags: list[str],
    path: str,
    fragment: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(text)
    rc = main(["run", str(cfg), "--dry-run", "--output-dir", str(tmp_path / "out"), *flags])
    out, err = capsys.readouterr()
    assert rc == 2
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, err
    path = path.replace("{file}", str(cfg))
    assert err.startswith(f"config error: {path}: "), err
    assert fragment in err, err
    assert not (tmp_path / "out").exists()  # nothing written for an invalid config


def test_error_table_is_large() -> None:
    assert len(CASES) >= 30
    assert len({c[0] for c in CASES}) == len(CASES)


def test_unknown_env_id_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("hpcrl.envs.registry")
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(BASE.replace('id = "reverse-text"', 'id = "primeintellect/no-such-env"'))
    assert main(["run", str(cfg), "--dry-run", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: orchestrator.train.env[0]: ") and err.count("\n") == 1
    assert "no-such-env" in err and "reverse-text" in err  # names the id and what exists
    assert "prime env install primeintellect/no-such-env" in err  # and how to install it


def test_hub_id_that_is_not_installed_is_never_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """primeintellect/gsm8k used to run the synthetic arithmetic env silently."""
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(BASE.replace('id = "reverse-text"', 'id = "primeintellect/gsm8k"'))
    assert main(["run", str(cfg), "--dry-run", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'primeintellect/gsm8k' is not installed" in err
    assert "prime env install primeintellect/gsm8k" in err


def test_bad_env_args_are_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("hpcrl.envs.registry")
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(
        BASE.replace('id = "reverse-text"', 'id = "alphabet-sort"\nargs = { min_turns = 3, bogus = 1 }')
    )
    assert main(["run", str(cfg), "--dry-run", "--output-dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: orchestrator.train.env[0]: ") and "bogus" in err


@pytest.mark.parametrize(
    ("text", "flags", "path", "fragment"),
    [
        ('[model]\nname = "hpcrl/tiny-qwen3"\n[data]\nname = ""\n', [], "data.name", "is required"),
        (
            '[model]\nname = "hpcrl/tiny-qwen3"\n[data]\nname = "d.jsonl"\nbatchsize = 4\n',
            [],
            "data.batchsize",
            "(did you mean 'batch_size'?)",
        ),
        (
            '[model]\nname = "hpcrl/tiny-qwen3"\n[data]\nname = "d.jsonl"\n',
            ["--loss-mask.assistant=maybe"],
            "loss_mask.assistant",
            "expected true or false",
        ),
        ('[model]\nname = ""\n[data]\nname = "d.jsonl"\n', [], "model.name", "is required"),
        (
            '[model]\nname = "m"\n[data]\nname = "d.jsonl"\n',
            ["--micro-batch-tokens", "64"],
            "micro_batch_tokens",
            "at least the packed row length (512)",
        ),
        ('[model]\nname = "m"\n[data]\nname = "d.jsonl"\n', ["--val.fraction", "1"], "val.fraction", "< 1"),
        (
            '[model]\nname = "m"\n[data]\nname = "d.jsonl"\n',
            ["--val.stop-at-loss", "1.5"],
            "val.stop_at_loss",
            "needs val.interval > 0",
        ),
        (
            '[model]\nname = "m"\n[data]\nname = "d.jsonl"\n',
            ["--val.stop-at-loss", "-1"],
            "val.stop_at_loss",
            ">= 0",
        ),
    ],
)
def test_bad_sft_config(
    text: str, flags: list[str], path: str, fragment: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "sft.toml"
    cfg.write_text(text)
    assert main(["sft", str(cfg), "--dry-run", "--output-dir", str(tmp_path / "o"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: {path}: ") and fragment in err and err.count("\n") == 1, err


def test_unknown_command_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["rn"]) == 2
    err = capsys.readouterr().err
    assert err == "hpcrl: error: unknown command 'rn' (did you mean 'run'?); see `hpcrl --help`\n"


def test_subprocess_exit_code_and_one_line_stderr(tmp_path: Path) -> None:
    """The real process: exit status 2, exactly one stderr line, no traceback, nothing on stdout."""
    cfg = tmp_path / "bad.toml"
    cfg.write_text(BASE + "[trainer.optim]\nlrr = 1e-5\n")
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcrl.cli",
            "run",
            str(cfg),
            "--dry-run",
            "--output-dir",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines() == [
        "config error: trainer.optim.lrr: unknown field in trainer.optim (did you mean 'lr'?)"
    ]
