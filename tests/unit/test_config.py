"""Config loading end to end: every shipped config passes --dry-run; merge and flag semantics;
resolved per-process configs with secrets redacted; the dry-run summary.

Errors (one line, exit 2) live in test_config_errors.py, the hosted shape in test_config_hosted.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hpcrl.cli import main
from hpcrl.config import Config, SFTConfig
from hpcrl.errors import ConfigError
from hpcrl.launch.checks import load
from tests.conftest import rl_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").rglob("*.toml"))


def _is_sft(path: Path) -> bool:
    return path.stem == "sft" or path.stem.startswith("sft_")


BASE = rl_toml()


@pytest.fixture
def base(tmp_path: Path) -> Path:
    p = tmp_path / "base.toml"
    p.write_text(BASE)
    return p


def write(tmp_path: Path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def cfg_of(*argv: str | Path) -> Config:
    return load([str(a) for a in argv]).config


# ---------------------------------------------------------------------------------------------
# shipped configs
# ---------------------------------------------------------------------------------------------
def test_configs_are_shipped() -> None:
    names = {str(p.relative_to(REPO / "configs")) for p in CONFIGS}
    for expected in (
        "demo/rl.toml",
        "demo/sft.toml",
        "reverse_text/rl.toml",
        "alphabet_sort/rl.toml",
        "multi_node/rl.toml",
        "multi_node/qwen3_235b.toml",
        "hosted/full_ft_single_node.toml",
        "hosted/full_ft_multi_node.toml",
        "hosted/hosted_reference.toml",
        "hosted/hosted_multi_env.toml",
    ):
        assert expected in names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_shipped_config_dry_run(path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "out"
    command = "sft" if _is_sft(path) else "run"
    rc = main([command, str(path), "--dry-run", "--output-dir", str(out_dir)])
    out, err = capsys.readouterr()
    if rc == 2 and "multi_node" in str(path.relative_to(REPO / "configs")):
        # A multi-node seed config is for `submit` (tests/integration/test_seed000_dry_run.py; the
        # 235B one: tests/unit/test_memory_plan.py); run here on one CPU rank it is refused in one
        # line, e.g. ep 8 over 1 trainer rank.
        assert err.startswith("config error: trainer.model.ep: 8 must divide") and err.count("\n") == 1, err
        return
    assert rc == 0, err
    assert err == ""
    assert out.startswith(f"hpcrl {command}")
    assert "dry run OK" in out.splitlines()[0]
    files = sorted(p.name for p in (out_dir / "configs").iterdir())
    expected = (
        ["sft.toml"]
        if command == "sft"
        else ["inference.toml", "orchestrator.toml", "resolved.toml", "trainer.toml"]
    )
    assert files == expected
    for f in files:  # every resolved file is valid TOML and names the run dir
        assert tomllib.loads((out_dir / "configs" / f).read_text())["output_dir"] == str(out_dir.absolute())


def test_full_ft_seed_configs_translate(tmp_path: Path) -> None:
    single = cfg_of(REPO / "configs/hosted/full_ft_single_node.toml")
    assert single.type == "full_finetune" and single.name == "reverse-text-full-ft"
    assert (single.deployment.num_train_gpus, single.deployment.num_infer_gpus) == (1, 1)
    assert single.orchestrator.train.sampling.max_tokens == 512  # from max_completion_tokens
    assert single.orchestrator.train.env[0].id == "primeintellect/reverse-text"
    assert single.orchestrator.renderer.name == "default"
    assert single.trainer.optim.lr == 3e-6 and single.model.lora is None

    multi = cfg_of(REPO / "configs/hosted/full_ft_multi_node.toml")
    assert (multi.deployment.num_train_nodes, multi.deployment.num_infer_nodes) == (2, 2)
    tm = multi.trainer.model
    # the docs' trainer model: hpcrl's own Qwen3-MoE, FA3, expert parallel over 8 ranks; the
    # full_finetune shape checkpoints activations unless told otherwise (docs/memory.md)
    assert tm is not None and (tm.impl, tm.attn, tm.ep) == ("custom", "flash_attention_3", 8)
    assert tm.activation_checkpointing
    assert tm.name == "Qwen/Qwen3-30B-A3B-Thinking-2507"  # shared model.name flowed in
    assert multi.inference.parallel.tp == 8
    assert multi.orchestrator.oversampling_factor == 2.0 and multi.orchestrator.max_off_policy_steps == 8
    assert multi.seq_len == multi.orchestrator.train.sampling.max_tokens == 32768
    assert multi.trainer.micro_batch_tokens >= multi.seq_len  # default grows with seq_len


# ---------------------------------------------------------------------------------------------
# merging and flags
# ---------------------------------------------------------------------------------------------
def test_files_merge_left_to_right_tables_deep_lists_replace(tmp_path: Path, base: Path) -> None:
    b = write(
        tmp_path,
        "b.toml",
        """
[orchestrator]
batch_size = 32
[orchestrator.train.sampling]
temperature = 0.5
[[orchestrator.train.env]]
id = "alphabet-sort"
[trainer.optim]
betas = [0.8, 0.9]
""",
    )
    c = write(tmp_path, "c.toml", "[trainer.optim]\nbetas = [0.5, 0.6]\n")
    cfg = cfg_of("@", base, "@", b, "@", c)
    o = cfg.orchestrator
    assert o.batch_size == 32 and o.rollouts_per_example == 4  # deep merge keeps base's sibling
    assert (o.train.sampling.max_tokens, o.train.sampling.temperature) == (16, 0.5)
    assert [e.id for e in o.train.env] == ["alphabet-sort"]  # lists replace, never append
    assert cfg.trainer.optim.betas == [0.5, 0.6]  # the last file wins
    assert cfg_of(f"@{base}", f"@{b}").orchestrator.batch_size == 32  # `@file` spelling


def test_positional_file_and_flags_override_files(base: Path) -> None:
    cfg = cfg_of(
        base,
        "--orchestrator.batch-size",
        "64",
        "--trainer.optim.lr",
        "3e-6",
        "--orchestrator.train.sampling.temperature=0.7",
        "--max-steps",
        "9",
    )
    assert cfg.orchestrator.batch_size == 64 and cfg.trainer.optim.lr == 3e-6
    assert cfg.orchestrator.train.sampling.temperature == 0.7
    assert cfg.max_steps == cfg.trainer.max_steps == cfg.orchestrator.max_steps == 9
    # a flag before the file still wins over it
    assert cfg_of("--orchestrator.batch-size", "8", base).orchestrator.batch_size == 8


def test_seed_doc_flags_exist(base: Path, tmp_path: Path) -> None:
    cfg = cfg_of(
        base,
        "--output-dir",
        str(tmp_path / "o"),
        "--max-steps",
        "40",
        "--clean-output-dir",
        "--ckpt.interval",
        "5",
        "--ckpt.keep-last",
        "3",
        "--ckpt.keep-interval",
        "10",
        "--ckpt.resume-step",
        "-1",
        "--ckpt.weights-only",
        "--wandb.project",
        "p",
        "--wandb.name",
        "n",
        "--model.name",
        "hpcrl/tiny-qwen3",
        "--server.port",
        "8001",
    )
    assert cfg.output_dir == str(tmp_path / "o") and cfg.max_steps == 40 and cfg.clean_output_dir
    assert cfg.ckpt is not None
    assert (cfg.ckpt.interval, cfg.ckpt.keep_last, cfg.ckpt.keep_interval) == (5, 3, 10)
    assert cfg.ckpt.resume_step == -1 and cfg.ckpt.weights_only
    assert cfg.wandb is not None and (cfg.wandb.project, cfg.wandb.name) == ("p", "n")
    assert cfg.server.port == 8001


def test_optional_sections_enable_and_disable(base: Path, tmp_path: Path) -> None:
    plain = cfg_of(base)
    assert plain.ckpt is None and plain.wandb is None
    ckpt = cfg_of(base, "--ckpt").ckpt
    assert ckpt is not None and ckpt.interval is None and ckpt.keep_last is None  # defaults
    implied = cfg_of(base, "--ckpt.interval", "5").ckpt
    assert implied is not None and implied.interval == 5
    wandb = cfg_of(base, "--wandb").wandb
    assert wandb is not None and wandb.project == "hpcrl"
    with_wandb = write(tmp_path, "w.toml", '[wandb]\nproject = "from-file"\n')
    assert cfg_of(base, "@", with_wandb).wandb is not None
    assert cfg_of(base, "@", with_wandb, "--no-wandb").wandb is None
    assert cfg_of(base, "--ckpt", "--no-ckpt").ckpt is None
    assert cfg_of(base, "--model.lora").model.lora is not None


def test_bool_flags(base: Path) -> None:
    assert cfg_of(base, "--deterministic").deterministic is True
    assert cfg_of(base, "--deterministic", "false").deterministic is False
    assert cfg_of(base, "--deterministic=true").deterministic is True
    assert cfg_of(base, "--deterministic", "--no-deterministic").deterministic is False


def test_section_file_flag(base: Path, tmp_path: Path) -> None:
    t = write(tmp_path, "t.toml", "micro_batch_tokens = 256\n[optim]\nlr = 2e-5\n")
    cfg = cfg_of(base, "--trainer", "@", t)
    assert cfg.trainer.optim.lr == 2e-5 and cfg.trainer.micro_batch_tokens == 256
    assert cfg_of(base, f"--trainer=@{t}").trainer.optim.lr == 2e-5
    # a later field flag still overrides the section file
    assert cfg_of(base, "--trainer", "@", t, "--trainer.optim.lr", "1e-4").trainer.optim.lr == 1e-4


def test_shared_fields_flow_into_sections(base: Path) -> None:
    cfg = cfg_of(base)
    for sec in (cfg.trainer, cfg.orchestrator, cfg.inference):
        assert sec.model is not None and sec.model.name == "hpcrl/tiny-qwen3"
    # seq_len is declared once (top level); a section's seq_len is the same setting, read there
    assert cfg.seq_len == 128 and not any(
        hasattr(s, "seq_len") for s in (cfg.trainer, cfg.orchestrator, cfg.inference)
    )
    assert cfg.inference.max_model_len == 128
    assert cfg_of(base, "--trainer.seq-len", "256").seq_len == 256  # a flag overrides the file, as --seq-len
    # a section may state the shared value itself, as long as it agrees
    same = cfg_of(base, "--trainer.max-steps", "5", "--orchestrator.model.name", "hpcrl/tiny-qwen3")
    assert same.max_steps == 5


def test_shared_value_set_only_in_a_section(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        "s.toml",
        BASE.replace("seq_len = 128\n", "").replace("[orchestrator]\n", "[orchestrator]\nseq_len = 256\n"),
    )
    cfg = cfg_of(p)
    assert cfg.seq_len == cfg.inference.max_model_len == 256


def test_aliases_in_files(base: Path) -> None:
    p = base.parent / "alias.toml"
    p.write_text(
        BASE.replace("rollouts_per_example", "group_size").replace("max_tokens", "max_completion_tokens")
    )
    cfg = cfg_of(p)
    assert cfg.orchestrator.rollouts_per_example == 4 and cfg.orchestrator.train.sampling.max_tokens == 16


def test_aliases_as_flags_override_the_files_field(base: Path) -> None:
    """prime-rl's flag names work on the command line too, and win over the file like any flag."""
    loaded = load(
        [str(base), "--orchestrator.group-size", "8", "--orchestrator.eval.sampling.max-completion-tokens=5"]
    )
    cfg = loaded.config
    assert cfg.orchestrator.rollouts_per_example == 8
    assert cfg.orchestrator.eval is not None and cfg.orchestrator.eval.sampling.max_tokens == 5
    with pytest.raises(
        ConfigError, match=r"orchestrator\.group_size \(= orchestrator\.rollouts_per_example\)"
    ):
        load([str(base), "--orchestrator.group-size"])


def test_nested_alias_moves_to_its_field_and_a_flag_overrides_it(base: Path) -> None:
    """prime-rl's `[ckpt.weights] save_adapter_separately` is hpcrl's `ckpt.save_adapter_separately`:
    the emptied table does not linger as an unknown field, a flag on the field wins over the alias in a
    file, and one file setting both differently is refused naming the alias."""
    from hpcrl.config.loader import apply_aliases

    d = {"ckpt": {"interval": 2, "weights": {"save_adapter_separately": True}}}
    apply_aliases(d)
    assert d == {"ckpt": {"interval": 2, "save_adapter_separately": True}}
    lora = "[model.lora]\nrank = 4\n"
    p = base.parent / "prime.toml"
    p.write_text(BASE + lora + "[ckpt.weights]\nsave_adapter_separately = true\n")
    assert cfg_of(p).ckpt.save_adapter_separately is True
    assert cfg_of(p, "--ckpt.save-adapter-separately", "false").ckpt.save_adapter_separately is False
    p.write_text(
        BASE
        + lora
        + "[ckpt]\nsave_adapter_separately = false\n[ckpt.weights]\nsave_adapter_separately = true\n"
    )
    with pytest.raises(ConfigError, match=r"ckpt\.weights\.save_adapter_separately: conflicts with"):
        cfg_of(p)


# ---------------------------------------------------------------------------------------------
# resolved configs and redaction
# ---------------------------------------------------------------------------------------------
def test_resolved_configs_per_role(base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert (
        main(["run", str(base), "--dry-run", "--output-dir", str(out), "--ckpt.interval", "2", "--wandb"])
        == 0
    )
    capsys.readouterr()
    d = {p.stem: tomllib.loads(p.read_text()) for p in (out / "configs").glob("*.toml")}
    # Every role gets the whole resolved config (roles read each other's sections), and shared
    # fields appear once, at the top level, so a reload can override them.
    for role in ("trainer", "orchestrator", "inference"):
        assert d[role] == d["resolved"]
    assert {"model", "trainer", "orchestrator", "inference", "ckpt", "wandb", "max_steps"} <= set(
        d["trainer"]
    )
    assert "max_steps" not in d["resolved"]["trainer"] and "seq_len" not in d["resolved"]["orchestrator"]
    assert d["resolved"]["orchestrator"]["batch_size"] == 16
    longer = cfg_of(out / "configs" / "resolved.toml", "--max-steps", "40", "--seq-len", "256")
    assert (longer.max_steps, longer.trainer.max_steps, longer.seq_len) == (40, 40, 256)
    # the resolved file is itself a loadable config (round trip)
    again = cfg_of(out / "configs" / "resolved.toml")
    assert again.orchestrator.batch_size == 16 and again.ckpt is not None and again.ckpt.interval == 2
    assert not (out / "rollouts").exists()  # a dry run creates nothing but configs/


def test_secrets_never_reach_resolved_configs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    secret_env = tmp_path / "secrets.env"
    secret_env.write_text("OPENAI_API_KEY=sk-envfilesecret0123456789\nCUSTOM_TOKEN=envfile-token-value\n")
    mod = tmp_path / "mods" / "secret_env_mod.py"
    mod.parent.mkdir()
    mod.write_text("def load_environment(**kwargs):\n    raise AssertionError('not built at config time')\n")
    monkeypatch.syspath_prepend(str(mod.parent))
    cfg = write(
        tmp_path,
        "s.toml",
        f'env_files = ["{secret_env}"]\n'
        + BASE
        + """
[[orchestrator.train.env]]
id = "secret_env_mod:load_environment"
args = { api_key = "sk-argsecret0123456789abcd", password = "hunter2-pw", split = "train" }
[slurm]
setup = ["export HF_TOKEN=hf_slurmsetupsecret0123456789", "module load cuda"]
""",
    )
    out = tmp_path / "run"
    assert main(["run", cfg, "--dry-run", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    written = "".join(p.read_text() for p in (out / "configs").glob("*.toml"))
    for secret in (
        "sk-envfilesecret0123456789",
        "envfile-token-value",
        "sk-argsecret0123456789abcd",
        "hunter2-pw",
        "hf_slurmsetupsecret0123456789",
    ):
        assert secret not in written and secret not in printed
    resolved = tomllib.loads((out / "configs" / "resolved.toml").read_text())
    assert resolved["env_files"] == [str(secret_env)]  # the path survives, the contents never enter
    args = resolved["orchestrator"]["train"]["env"][1]["args"]
    # Literal secrets become references to variables the launcher gives its children (never a
    # corrupted "***" value: the roles start from these files).
    assert args == {
        "api_key": "${env:HPCRL_SECRET_ORCHESTRATOR_TRAIN_ENV_1_ARGS_API_KEY}",
        "password": "${env:HPCRL_SECRET_ORCHESTRATOR_TRAIN_ENV_1_ARGS_PASSWORD}",
        "split": "train",
    }
    assert resolved["slurm"]["setup"] == ["${env:HPCRL_SECRET_SLURM_SETUP_0}", "module load cuda"]
    for role in ("trainer", "orchestrator", "inference"):
        assert tomllib.loads((out / "configs" / f"{role}.toml").read_text()) == resolved


def test_hosted_env_file_is_not_read_or_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    env = tmp_path / "secrets.env"
    env.write_text("OPENAI_API_KEY=sk-hostedsecret0123456789\n")
    cfg = write(
        tmp_path,
        "h.toml",
        f"""
model = "Qwen/Qwen3-4B"
max_steps = 3
batch_size = 8
rollouts_per_example = 4
env_file = ["{env}"]
[sampling]
max_tokens = 64
[[env]]
id = "primeintellect/reverse-text"
""",
    )
    out = tmp_path / "run"
    assert main(["run", cfg, "--dry-run", "--output-dir", str(out)]) == 0
    assert "sk-hostedsecret" not in capsys.readouterr().out
    assert all("sk-hostedsecret" not in p.read_text() for p in (out / "configs").glob("*.toml"))


# ---------------------------------------------------------------------------------------------
# summary
# ---------------------------------------------------------------------------------------------
def test_run_summary_lines(base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert main(["run", str(base), "--dry-run", "--output-dir", str(out), "--ckpt.interval", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "hpcrl run (this machine): dry run OK"
    text = "\n".join(lines)
    for expected in (
        "model:        hpcrl/tiny-qwen3",
        "steps:        5 (algo grpo",
        "batch:        16 rollouts = 4 tasks x 4, seq_len 128, max_tokens 16",
        "envs:         reverse-text",
        "trainer:      1 rank(s)",
        "inference:    1 server(s)",
        "checkpoints:  every 2 step(s)",
        f"configs:      {out.absolute()}/configs/",
    ):
        assert expected in text
    assert len(lines) < 20  # short


def test_sft_summary_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hpcrl.launch.prepare import print_sft_summary

    out = tmp_path / "sft"
    base = ["--model.name", "hpcrl/tiny-qwen3", "--data.name", "x.jsonl", "--output-dir", str(out)]
    print_sft_summary(load([*base, "--model.lora", "--ckpt.interval", "3"], SFTConfig))
    print_sft_summary(load(base, SFTConfig))
    first, second = capsys.readouterr().out.split("hpcrl sft: dry run OK\n")[1:]
    assert "model:        hpcrl/tiny-qwen3 (LoRA)\n" in first and "checkpoints:  every 3 step(s)\n" in first
    assert (
        "model:        hpcrl/tiny-qwen3\n" in second and "checkpoints:  off (enable with --ckpt)\n" in second
    )
    assert f"configs:      {out.absolute()}/configs/" in second


def test_summary_reports_platform_only_fields(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = REPO / "configs/hosted/hosted_multi_env.toml"
    assert main(["run", str(path), "--dry-run", "--output-dir", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "model:        Qwen/Qwen3-30B-A3B-Instruct-2507 (LoRA)" in out
    assert "envs:         alphabet-sort, arithmetic" in out
    # the Hub id with no package installed runs the built-in, and says so
    assert any(
        "primeintellect/alphabet-sort" in line and "alias" in line
        for line in out.splitlines()
        if line.startswith("note:")
    )
    assert any("compute_size" in line and "env_workers" in line for line in out.splitlines())
    for ignored in ("checkpoints.keep_cloud", "adapters.keep_last"):
        assert any(
            ignored in line and "ignored" in line for line in out.splitlines() if line.startswith("note:")
        )


def test_sft_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sft"
    rc = main(
        [
            "sft",
            str(REPO / "configs/demo/sft.toml"),
            "--dry-run",
            "--output-dir",
            str(out),
            "--data.batch-size",
            "8",
            "--ckpt",
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert "data:         outputs/demo-sft-data/train.jsonl (batch 8 samples, seq_len 128)" in text
    sft = load([str(REPO / "configs/demo/sft.toml")], SFTConfig).config
    assert isinstance(sft, SFTConfig) and sft.loss_mask.assistant and not sft.loss_mask.user
    written = tomllib.loads((out / "configs" / "sft.toml").read_text())
    assert written["data"]["batch_size"] == 8 and "ckpt" in written


def test_clean_output_dir_is_not_applied_by_dry_run(
    base: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    (out / "keep").mkdir(parents=True)
    assert main(["run", str(base), "--dry-run", "--clean-output-dir", "--output-dir", str(out)]) == 0
    capsys.readouterr()
    assert (out / "keep").is_dir()


def test_a_roles_wandb_overrides_need_wandb_on(base: Path) -> None:
    """Parsed and then ignored would be a silent no-op: refused in one line naming the section."""
    with pytest.raises(ConfigError, match=r"^trainer\.wandb: needs W&B on"):
        cfg_of(base, "--trainer.wandb.log-extras.interval", "5")
    assert cfg_of(base, "--wandb", "--trainer.wandb.log-extras.interval", "5").trainer.wandb is not None
