"""prime-rl's config shapes of today (hpcrl.config.prime_shapes, prime_sources): each table lands on
the hpcrl field that does the same thing; what exists only on Prime's platform is a note; the rest is
a one-line error naming the key. Configs here are written in prime-rl's shape (its 2026-08-21 layout)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from hpcrl.config.loader import load
from hpcrl.config.schema import Config, SFTConfig
from hpcrl.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
V1_DIR = ROOT / "tests" / "vf1_envs"

RL = """
max_steps = 20
seq_len = 2048

[deployment]
type = "single_node"
num_train_gpus = 1
num_infer_gpus = 1

[model]
name = "hpcrl/tiny-qwen3"

[monitors.wandb]
project = "reverse-text"
name = "reverse-text"
group = "ablations"
tags = ["a", "b"]

[monitors.prime]
name = "x"

[orchestrator]
batch_size = 128
group_size = 16

[orchestrator.concurrency]
max_inflight = 96

[orchestrator.train.sampling]
max_completion_tokens = 128

[[orchestrator.train.source]]
name = "reverse-text"
ratio = 2.0
curriculum = { gates = { zero_advantage = { type = "advantage_range" } } }

[orchestrator.train.source.env.taskset]
id = "reverse-text"

[orchestrator.train.source.env.agent.harness]
id = "null"

[orchestrator.train.source.env.agent.runtime]
type = "subprocess"

[weight_broadcast]
type = "nccl"
timeout = 900

[trainer.optim]
lr = 3e-6

[ckpt]

[inference]

[orchestrator.renderer]
name = "default"
reasoning_parser = "think"
"""


def _write(tmp_path: Path, text: str, name: str = "rl.toml") -> str:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def _load(*argv: str, root: type = Config, role: str | None = None, require_envs: bool = True):
    from hpcrl.launch.checks import role_checks

    return load(list(argv), root, role=role, require_envs=require_envs, checks=role_checks)


def test_an_rl_config_of_today_lands_on_hpcrl_fields(tmp_path):
    loaded = _load("@", _write(tmp_path, RL), "--output-dir", str(tmp_path / "out"))
    c = loaded.config
    assert (c.wandb.project, c.wandb.name, c.wandb.group, c.wandb.tags) == (
        "reverse-text",
        "reverse-text",
        "ablations",
        ["a", "b"],
    )
    conc = c.orchestrator.concurrency
    assert (conc.mode, conc.max_inflight, c.orchestrator.max_concurrent) == ("adaptive", 96, 256)
    assert c.orchestrator.rollouts_per_example == 16
    assert (c.trainer.broadcast.transport, c.trainer.broadcast.timeout_s) == ("collective", 900.0)
    assert c.orchestrator.advantage.zero_advantage == "drop"
    assert c.orchestrator.renderer.reasoning_parser == "think"
    env = c.orchestrator.train.env[0]
    # no 'reverse-text' taskset installed: hpcrl's own env of that name runs, said in a note
    assert (env.id, env.name, env.ratio, env.env, env.runtime) == (
        "reverse-text",
        "reverse-text",
        2.0,
        {},
        None,
    )
    text = "\n".join(loaded.notes)
    assert "monitors.prime" in text and "Prime platform" in text
    assert "not installed as a verifiers 0.4 package; running hpcrl's env 'reverse-text'" in text


def test_a_source_with_an_installed_taskset_keeps_its_verifiers_table(tmp_path, monkeypatch):
    pytest.importorskip("verifiers.v1")
    monkeypatch.syspath_prepend(str(V1_DIR))
    text = RL.replace(
        'id = "reverse-text"\n\n[orchestrator.train.source.env.agent.harness]',
        'id = "vf1_tool_env"\nnum_tasks = 3\n\n[orchestrator.train.source.env.agent.harness]',
    )
    text = text.replace(
        'id = "null"', 'id = "null"\n\n[orchestrator.train.source.env.agent.timeout]\nrollout = 1200'
    )
    c = _load("@", _write(tmp_path, text), "--output-dir", str(tmp_path / "out")).config
    env = c.orchestrator.train.env[0]
    assert env.id == "vf1_tool_env" and env.runtime == "subprocess"
    assert env.env["taskset"] == {"id": "vf1_tool_env", "num_tasks": 3}
    assert env.rollout_timeout_s == 1260.0  # verifiers' own rollout timeout fires first
    from hpcrl.envs.verifiers.v1_env import env_config

    config, _ = env_config(env.id, env.args, env.runtime, env.env)
    assert config.taskset.num_tasks == 3 and config.agent.runtime.type == "subprocess"


def test_a_harness_needs_the_real_taskset(tmp_path):
    text = RL.replace('id = "null"', 'id = "bash"')
    with pytest.raises(ConfigError) as e:
        _load("@", _write(tmp_path, text))
    assert e.value.path == "orchestrator.train.env[0].env.taskset.id"
    assert "not installed as a verifiers 0.4 package" in e.value.message


@pytest.mark.parametrize(
    ("patch", "path", "words"),
    [
        (
            '[[orchestrator.train.source]]\nname = "x"\nbogus = 1\n',
            "orchestrator.train.source[1].bogus",
            "unknown",
        ),
        ('[[orchestrator.train.source]]\nname = "x"\n', "orchestrator.train.source[1].env", "required"),
        (
            '[[orchestrator.train.source]]\nname = "y"\ngroup_size = 4\nenv = { taskset = { id = "reverse-text" } }\n',
            "orchestrator.train.source[1].group_size",
            "per-source",
        ),
        (
            '[[orchestrator.train.source]]\nname = "y"\nalgo = { type = "opd" }\nenv = { taskset = { id = "reverse-text" } }\n',
            "orchestrator.train.env[1].algo.teacher",  # per-source algo is read: opd needs a teacher
            "needs a teacher",
        ),
        ('[resume]\nstep = 3\ndir = "a/step_3"\n', "resume.dir", "excludes"),
        ('[resume]\ndir = "a/b"\n', "resume.dir", "step_N"),
        ('[monitors.file]\npath = "other.jsonl"\n', "monitors.file.path", "metrics.jsonl"),
        ('[model.vlm]\nvision_encoder_attr = "not a path"\n', "model.vlm", "dotted attribute path"),
        ('[orchestrator.model]\nname = "org/Model-FP8"\n', "orchestrator.model.name", "FP8 copy"),
        ("[deployment2]\n", "deployment2", "unknown"),
    ],
)
def test_bad_prime_rl_shapes_are_one_line_errors(tmp_path, patch, path, words):
    base = RL.replace('[monitors.prime]\nname = "x"\n', "")
    if patch.startswith("[[orchestrator.train.source]]"):
        text = base + patch
    else:
        text = base + "\n" + patch
    with pytest.raises(ConfigError) as e:
        _load("@", _write(tmp_path, text))
    assert e.value.path == path
    assert words in e.value.message and "\n" not in e.value.message


def test_resume_table_and_flags_resolve_like_hpcrl_resume(tmp_path):
    base = _write(tmp_path, RL)
    extra = _write(tmp_path, "[resume]\n", "resume.toml")
    c = load(["@", base, "@", extra], Config, require_envs=False).config
    assert c.ckpt.resume_step == -1
    c = load(["@", base, "--resume.step", "7", "--clean"], Config, require_envs=False).config
    assert (c.ckpt.resume_step, c.clean_output_dir) == (7, True)
    c = load(["@", base, "--resume"], Config, require_envs=False).config
    assert c.ckpt.resume_step == -1
    fork = _write(tmp_path, '[resume]\ndir = "other/checkpoints/step_50"\n', "fork.toml")
    c = load(["@", base, "@", fork], Config, require_envs=False).config
    assert (c.ckpt.warm_start, c.ckpt.warm_start_optimizer, c.ckpt.resume_step) == (
        "other/checkpoints/step_50",
        True,
        None,
    )


def test_monitor_and_broadcast_flags(tmp_path):
    notes: list[str] = []
    loaded = load(
        [
            "@",
            _write(tmp_path, RL),
            "--monitors.wandb.project",
            "p2",
            "--no-monitors.file",
            "--weight-broadcast.type",
            "filesystem",
            "--orchestrator.concurrency.max-inflight",
            "12",
        ],
        Config,
        require_envs=False,
    )
    notes = loaded.notes
    c = loaded.config
    assert (c.wandb.project, c.trainer.broadcast.transport, c.orchestrator.concurrency.max_inflight) == (
        "p2",
        "filesystem",
        12,
    )
    assert any("metrics.jsonl is always written" in n for n in notes)


def test_run_table_names_the_run_directory(tmp_path):
    c = load(
        ["@", _write(tmp_path, RL + '\n[run]\nname = "exp1"\n'), "--output-dir", "outs"],
        Config,
        require_envs=False,
    ).config
    # flags apply after files: --output-dir replaces the file's directory, [run] names it within the file
    assert c.name == "exp1"
    c = load(
        ["@", _write(tmp_path, 'output_dir = "outs"\n' + RL + '\n[run]\nname = "exp1"\n')],
        Config,
        require_envs=False,
    ).config
    assert c.output_dir == "outs/exp1"


def test_multi_node_replicas_multiply_the_inference_nodes(tmp_path):
    text = RL.replace(
        '[deployment]\ntype = "single_node"\nnum_train_gpus = 1\nnum_infer_gpus = 1',
        '[deployment]\ntype = "multi_node"\nnum_train_nodes = 2\nnum_infer_nodes = 2\nnum_infer_replicas = 3',
    )
    c = load(["@", _write(tmp_path, text)], Config, require_envs=False).config
    assert (c.deployment.num_train_nodes, c.deployment.num_infer_nodes) == (2, 6)
    bad = RL.replace("num_train_gpus = 1", "num_train_gpus = 1\nnum_train_nodes = 2")
    with pytest.raises(ConfigError) as e:
        load(["@", _write(tmp_path, bad)], Config, require_envs=False)
    assert e.value.path == "deployment.num_train_nodes"


def test_orchestrator_lora_table(tmp_path):
    text = RL + '\n[orchestrator.model.lora]\nname = "r8"\nrank = 8\n\n[trainer.model.lora]\nrank = 8\n'
    loaded = load(["@", _write(tmp_path, text)], Config, require_envs=False)
    assert loaded.config.trainer.model.lora.rank == 8
    assert any("served as 'policy-lora'" in n for n in loaded.notes)
    with pytest.raises(ConfigError) as e:
        load(
            ["@", _write(tmp_path, text.replace("rank = 8\n\n", "rank = 4\n\n", 1))],
            Config,
            require_envs=False,
        )
    assert e.value.path == "orchestrator.model.lora.rank"


SPLIT = {
    "train.toml": """
        max_steps = 20
        [model]
        name = "hpcrl/tiny-qwen3"
        seq_len = 2048
        [monitors.wandb]
        project = "reverse-text"
        [optim]
        lr = 3e-6
        [ckpt]
    """,
    "orch.toml": """
        max_steps = 20
        seq_len = 2048
        batch_size = 128
        group_size = 16
        [model]
        name = "hpcrl/tiny-qwen3"
        [train.sampling]
        max_completion_tokens = 128
        [[train.source]]
        name = "reverse-text"
        [train.source.env.taskset]
        id = "reverse-text"
        [renderer]
        name = "default"
    """,
}


def test_split_role_files_read_as_their_role(tmp_path):
    train = _write(tmp_path, SPLIT["train.toml"], "train.toml")
    c = load(["@", train], Config, role="trainer", require_envs=False).config
    assert (c.trainer.optim.lr, c.max_steps, c.wandb.project) == (3e-6, 20, "reverse-text")
    orch = _write(tmp_path, SPLIT["orch.toml"], "orch.toml")
    c = load(["@", orch], Config, role="orchestrator").config
    assert (c.orchestrator.batch_size, c.orchestrator.rollouts_per_example) == (128, 16)
    assert c.orchestrator.train.sampling.max_tokens == 128
    assert c.orchestrator.train.env[0].id == "reverse-text"
    # the same file given to `hpcrl run` is not a role file: its keys are refused by name
    with pytest.raises(ConfigError) as e:
        load(["@", orch], Config)
    assert e.value.path in ("batch_size", "group_size", "renderer", "train")


def test_sft_config_of_today(tmp_path):
    text = """
        max_steps = 5
        [model]
        name = "hpcrl/tiny-qwen3"
        [data]
        name = "x.jsonl"
        batch_size = 4
        seq_len = 256
        micro_batch_size = 2
        [data.loss_mask]
        user = true
        [monitors.wandb]
        project = "sft"
        [resume]
        step = 3
    """
    c = load(["@", _write(tmp_path, text, "sft.toml")], SFTConfig).config
    assert (c.micro_batch_tokens, c.loss_mask.user, c.wandb.project, c.ckpt.resume_step) == (
        512,
        True,
        "sft",
        3,
    )
    fake = load(["@", _write(tmp_path, text + "[data.fake]\nbatch_size = 2\n", "f.toml")], SFTConfig).config
    assert (fake.data.type, fake.data.batch_size) == ("fake", 2)  # the trainer's [data.fake] shape
    with pytest.raises(ConfigError) as e:
        bad = text.replace("micro_batch_size = 2", 'micro_batch_size = 2\ninput_ids = "random"')
        load(["@", _write(tmp_path, bad, "g.toml")], SFTConfig)
    assert e.value.path == "data.input_ids"  # a fake-data field on real data


def test_the_corpus_script_classifies_prime_rl_files(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from prime_rl_configs import prime_command
    finally:
        sys.path.pop(0)
    (tmp_path / "k8s" / "x").mkdir(parents=True)
    (tmp_path / "configs" / "infer").mkdir(parents=True)
    for rel, body in [
        ("k8s/x/train.toml", ""),
        ("k8s/x/orch.toml", ""),
        ("configs/infer/pd.toml", ""),
        ("configs/a.toml", "[data]\nname = 'x'\n"),
        ("configs/b.toml", "max_steps = 1\n"),
    ]:
        (tmp_path / rel).write_text(body)
    got = [
        prime_command(tmp_path / r, tmp_path)
        for r in (
            "k8s/x/train.toml",
            "k8s/x/orch.toml",
            "configs/infer/pd.toml",
            "configs/a.toml",
            "configs/b.toml",
        )
    ]
    assert got == ["trainer", "orchestrator", "inference", "sft", "rl"]


def test_a_missing_model_name_is_prime_rls_default(tmp_path):
    text = RL.replace('[model]\nname = "hpcrl/tiny-qwen3"\n', "")
    loaded = load(["@", _write(tmp_path, text)], Config, require_envs=False)
    assert loaded.config.model.name == "Qwen/Qwen3-0.6B"
    assert loaded.config.trainer.model.name == "Qwen/Qwen3-0.6B"
    assert any("prime-rl's default Qwen/Qwen3-0.6B" in n for n in loaded.notes)
    sft = load(["@", _write(tmp_path, "max_steps = 3\n", "s.toml")], SFTConfig)
    assert (sft.config.model.name, sft.config.data.name) == (
        "Qwen/Qwen3-0.6B",
        "PrimeIntellect/Reverse-Text-SFT",
    )


def test_an_evals_config_of_today(tmp_path):
    from hpcrl.config.schema import EvalRunConfig

    text = """
        model = "org/some-model"
        [eval]
        num_examples = 7
        group_size = 2
        interval = 10
        [eval.client]
        base_url = "http://127.0.0.1:9/v1"
        api_key_var = "MY_KEY"
        [eval.concurrency]
        min_inflight = 32
        max_inflight = 32
        [eval.sampling]
        max_completion_tokens = 64
        [[eval.source]]
        name = "rt"
        group_size = 3
        [eval.source.env.taskset]
        id = "reverse-text"
    """
    loaded = load(["@", _write(tmp_path, text, "evals.toml")], EvalRunConfig)
    c = loaded.config
    assert (c.model, c.num_examples, c.rollouts_per_example) == ("org/some-model", 7, 2)
    assert (c.client.base_url, c.client.api_key_var, c.client.max_concurrent) == (
        "http://127.0.0.1:9/v1",
        "MY_KEY",
        32,
    )
    assert c.sampling.max_tokens == 64
    e = c.env[0]
    assert (e.id, e.name, e.rollouts_per_example, e.env) == (
        "reverse-text",
        "rt",
        3,
        {"taskset": {"id": "reverse-text"}},
    )
    assert any("eval.interval" in n for n in loaded.notes)
