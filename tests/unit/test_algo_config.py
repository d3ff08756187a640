"""[orchestrator.algo] as config: prime-rl's tables parse, hpcrl's older keys (training_mode,
[orchestrator.teacher], advantage.length_penalty) set the same table, and what prime-rl refuses is
refused in one line naming the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.config.loader import load
from hpcrl.config.sections.algo import AlgoConfig, FrozenModelConfig, LengthPenaltyConfig
from hpcrl.errors import ConfigError
from hpcrl.trainer.setup import loss_params
from tests.conftest import rl_toml

BASE = rl_toml()
TEACHER = '[orchestrator.algo.teacher]\nname = "PrimeIntellect/Qwen3-0.6B-Reverse-Text-RL"\nbase_url = "http://localhost:8001/v1"\n'

# The [orchestrator.algo] tables of prime-rl's configs/debug/algo/*.toml and examples/ (verbatim).
PRIME_TABLES = {
    "grpo": '[orchestrator.algo]\ntype = "grpo"\n',
    "grpo-length-penalty": '[orchestrator.algo]\ntype = "grpo"\n[orchestrator.algo.length_penalty]\n'
    'type = "linear"\nnum_output_tokens_weight = 0.0\nnum_input_tokens_weight = 0.1\nnum_turns_weight = 0.1\n',
    "max_rl": '[orchestrator.algo]\ntype = "max_rl"\n',
    "rae": '[orchestrator.algo]\ntype = "rae"\n',
    "opd": '[orchestrator.algo]\ntype = "opd"\n' + TEACHER,
    "sft": '[orchestrator.algo]\ntype = "sft"\n[orchestrator.algo.sampling.source]\n'
    'name = "PrimeIntellect/Qwen3-0.6B-Reverse-Text-RL"\nbase_url = "http://localhost:8001/v1"\n',
    "opsd": '[orchestrator.algo]\ntype = "opsd"\ndemo_key = "answer"\n',
    "echo": '[orchestrator.algo]\ntype = "echo"\n[orchestrator.algo.roles.user]\nalpha = 0.1\n',
}


def config(tmp_path: Path, extra: str = "", *flags: str):
    f = tmp_path / "cfg.toml"
    f.write_text(BASE + extra)
    return load([str(f), "--output-dir", str(tmp_path / "out"), *flags]).config


@pytest.mark.parametrize("name", sorted(PRIME_TABLES))
def test_prime_rl_algo_tables_parse(name: str, tmp_path: Path) -> None:
    algo = config(tmp_path, PRIME_TABLES[name]).orchestrator.algo  # opsd: max_model_len 2 x seq_len
    assert algo.type == name.split("-")[0]


def test_prime_rl_fields_land_where_the_code_reads_them(tmp_path: Path) -> None:
    lp = config(tmp_path, PRIME_TABLES["grpo-length-penalty"]).orchestrator.algo.length_penalty
    assert lp == LengthPenaltyConfig(
        num_output_tokens_weight=0.0, num_input_tokens_weight=0.1, num_turns_weight=0.1
    )
    # `[orchestrator.algo.length_penalty] type = "linear"` alone is prime-rl's defaults 0.25 / 0.1 / 0.1
    lp = config(
        tmp_path, '[orchestrator.algo.length_penalty]\ntype = "linear"\n'
    ).orchestrator.algo.length_penalty
    assert (lp.num_output_tokens_weight, lp.num_input_tokens_weight, lp.num_turns_weight) == (0.25, 0.1, 0.1)
    opd = config(tmp_path, PRIME_TABLES["opd"]).orchestrator.algo
    assert opd.frozen == FrozenModelConfig(
        base_url="http://localhost:8001/v1", name="PrimeIntellect/Qwen3-0.6B-Reverse-Text-RL"
    )
    assert opd.frozen.api_key_var == "VLLM_API_KEY"  # prime-rl's ClientConfig default
    sft = config(tmp_path, PRIME_TABLES["sft"]).orchestrator.algo
    assert sft.frozen is not None and sft.frozen.base_url == "http://localhost:8001/v1"
    # echo (prime-rl's configs/debug/algo/echo.toml): setting a role replaces the default table
    echo = config(tmp_path, PRIME_TABLES["echo"]).orchestrator.algo
    assert echo.roles.user.alpha == 0.1 and echo.roles.tool is None and echo.filter is None
    assert echo.loss_mode == "rl"  # the trainer's rl loss, plus the ce term where batches carry weights
    assert AlgoConfig(type="echo").roles.tool.alpha == 0.1  # the default: tool bodies at 0.1
    filt = '[orchestrator.algo.filter]\nimport_path = "tests.unit.test_echo.keep_first_tokens"\nkwargs = {n = 2}\n'
    echo = config(tmp_path, PRIME_TABLES["echo"] + filt).orchestrator.algo
    assert (echo.filter.import_path, echo.filter.kwargs) == (
        "tests.unit.test_echo.keep_first_tokens",
        {"n": 2},
    )
    rae = config(tmp_path, "", "--orchestrator.algo.type", "rae", "--orchestrator.algo.decay", "0.9")
    assert (rae.orchestrator.algo.type, rae.orchestrator.algo.decay) == ("rae", 0.9)


def test_default_is_grpo_and_the_trainer_loss_follows_the_type(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    assert cfg.orchestrator.algo.type == "grpo" and cfg.orchestrator.algo.length_penalty is None
    assert loss_params(cfg.trainer.loss, cfg.orchestrator.algo.loss_mode).mode == "rl"
    for name, mode in (("opd", "opd"), ("sft", "sft"), ("opsd", "opd"), ("max_rl", "rl")):
        cfg = config(tmp_path, PRIME_TABLES[name], "--inference.max-model-len", "256")
        assert loss_params(cfg.trainer.loss, cfg.orchestrator.algo.loss_mode).mode == mode


# -- hpcrl's older keys set the same table -----------------------------------------------------
def test_training_mode_and_teacher_set_algo(tmp_path: Path) -> None:
    teacher = '[orchestrator.teacher]\nbase_url = "http://127.0.0.1:8001/v1"\nmodel = "t"\n'
    o = config(tmp_path, teacher, "--orchestrator.training-mode", "opd").orchestrator
    assert (o.algo.type, o.training_mode, o.teacher) == ("opd", None, None)
    # the older section's own api_key_var default (OPENAI_API_KEY) is carried over
    assert o.algo.teacher == FrozenModelConfig(
        base_url="http://127.0.0.1:8001/v1", name="t", api_key_var="OPENAI_API_KEY"
    )
    o = config(tmp_path, teacher, "--orchestrator.training-mode", "sft").orchestrator
    assert o.algo.type == "sft" and o.algo.sampling.source == o.algo.frozen and o.algo.frozen.name == "t"
    o = config(tmp_path, "", "--orchestrator.training-mode", "rl").orchestrator
    assert o.algo.type == "grpo" and o.training_mode is None


def test_prime_rl_older_teacher_client_table(tmp_path: Path) -> None:
    # prime-rl's earlier [orchestrator.teacher.client] (hpcrl.config.prime_names) reaches algo.teacher
    extra = '[orchestrator.teacher.client]\nbase_url = ["http://localhost:8001/v1"]\n'
    o = config(tmp_path, extra, "--orchestrator.training-mode", "opd").orchestrator
    assert o.algo.type == "opd" and o.algo.teacher.base_url == "http://localhost:8001/v1"


def test_older_length_penalty_is_the_output_term(tmp_path: Path) -> None:
    o = config(tmp_path, "", "--orchestrator.advantage.length-penalty", "0.2").orchestrator
    assert o.algo.length_penalty == LengthPenaltyConfig(
        num_output_tokens_weight=0.2, num_input_tokens_weight=0.0, num_turns_weight=0.0
    )
    assert o.advantage.length_penalty == 0.0  # read once, as the new table


# -- refused, one line naming the field ------------------------------------------------------------
REFUSED = [
    (
        "policy-only",
        PRIME_TABLES["grpo"] + '[orchestrator.algo.sampling.source]\nbase_url = "http://x/v1"\n',
        (),
        "orchestrator.algo.sampling.source",
        "allowed 'policy'",
    ),
    (
        "opd-frozen-source",
        PRIME_TABLES["opd"] + '[orchestrator.algo.sampling.source]\nbase_url = "http://x/v1"\n',
        (),
        "orchestrator.algo.sampling.source",
        "ref_kl loss",
    ),
    (
        "sft-needs-frozen",
        '[orchestrator.algo]\ntype = "sft"\n',
        (),
        "orchestrator.algo.sampling.source",
        "frozen model",
    ),
    (
        "opd-needs-teacher",
        '[orchestrator.algo]\ntype = "opd"\n',
        (),
        "orchestrator.algo.teacher",
        "name + base_url",
    ),
    (
        "teacher-needs-base-url",
        '[orchestrator.algo]\ntype = "opd"\n[orchestrator.algo.teacher]\nname = "t"\n',
        (),
        "orchestrator.algo.teacher.base_url",
        "required",
    ),
    ("decay-of-grpo", "[orchestrator.algo]\ndecay = 0.5\n", (), "orchestrator.algo.decay", "type rae"),
    ("teacher-of-sft", PRIME_TABLES["sft"] + TEACHER, (), "orchestrator.algo.teacher", "type opd"),
    (
        "length-penalty-of-max-rl",
        '[orchestrator.algo]\ntype = "max_rl"\n[orchestrator.algo.length_penalty]\n',
        (),
        "orchestrator.algo.length_penalty",
        "grpo / echo",
    ),
    (
        "unknown-type",
        '[orchestrator.algo]\ntype = "ppo"\n',
        (),
        "orchestrator.algo.type",
        "invalid value 'ppo'",
    ),
    (
        "unknown-field",
        '[orchestrator.algo]\ntype = "grpo"\nalpha = 1\n',
        (),
        "orchestrator.algo.alpha",
        "unknown",
    ),
    ("decay-range", '[orchestrator.algo]\ntype = "rae"\ndecay = 1.0\n', (), "orchestrator.algo.decay", "< 1"),
    (  # unset, max_model_len is 2 x seq_len for opsd (hpcrl.config.loader.flow_shared); set to seq_len:
        "opsd-room",
        PRIME_TABLES["opsd"],
        ("--inference.max-model-len", "128"),
        "inference.max_model_len",
        "128: type = 'opsd' scores",
    ),
    (
        "echo-no-role",
        '[orchestrator.algo]\ntype = "echo"\n[orchestrator.algo.roles]\n',
        (),
        "orchestrator.algo.roles",
        "at least one role",
    ),
    (
        "echo-unknown-role",
        '[orchestrator.algo]\ntype = "echo"\n[orchestrator.algo.roles.developer]\nalpha = 0.1\n',
        (),
        "orchestrator.algo.roles.developer",
        "unknown",
    ),
    (
        "echo-alpha-zero",
        '[orchestrator.algo]\ntype = "echo"\n[orchestrator.algo.roles.tool]\nalpha = 0.0\n',
        (),
        "orchestrator.algo.roles.tool.alpha",
        "> 0",
    ),
    (
        "echo-alpha-inf",
        '[orchestrator.algo]\ntype = "echo"\n[orchestrator.algo.roles.user]\nalpha = inf\n',
        (),
        "orchestrator.algo.roles.user.alpha",
        "finite",
    ),
    (
        "echo-alpha-text",
        '[orchestrator.algo]\ntype = "echo"\n[orchestrator.algo.roles.user]\nalpha = "big"\n',
        (),
        "orchestrator.algo.roles.user.alpha",
        "float",
    ),
    (
        "echo-filter-missing",
        PRIME_TABLES["echo"] + '[orchestrator.algo.filter]\nimport_path = "no_such_module_x.f"\n',
        (),
        "orchestrator.algo.filter.import_path",
        "cannot be imported",
    ),
    (
        "echo-filter-not-callable",
        PRIME_TABLES["echo"] + '[orchestrator.algo.filter]\nimport_path = "math.pi"\n',
        (),
        "orchestrator.algo.filter.import_path",
        "not a callable",
    ),
    (
        "echo-filter-without-path",
        PRIME_TABLES["echo"] + "[orchestrator.algo.filter]\nkwargs = {}\n",
        (),
        "orchestrator.algo.filter.import_path",
        "required",
    ),
    (
        "roles-of-grpo",
        '[orchestrator.algo]\ntype = "grpo"\n[orchestrator.algo.roles.user]\nalpha = 0.1\n',
        (),
        "orchestrator.algo.roles",
        "type echo",
    ),
    (
        "hierarchical",
        '[orchestrator.algo]\ntype = "hierarchical_grpo"\nepisode_agents = ["solver"]\n',
        (),
        "orchestrator.algo.type",
        "not implemented",
    ),
    (
        "both-names",
        PRIME_TABLES["max_rl"],
        ("--orchestrator.training-mode", "rl"),
        "orchestrator.training_mode",
        "older name",
    ),
    (
        "old-teacher-with-algo",
        PRIME_TABLES["grpo"] + '[orchestrator.teacher]\nbase_url = "http://x/v1"\n',
        (),
        "orchestrator.teacher",
        "older name",
    ),
    (
        "opd-mode-without-teacher",
        "",
        ("--orchestrator.training-mode", "opd"),
        "orchestrator.teacher",
        "training_mode = 'opd' needs [orchestrator.teacher] base_url",
    ),
    (
        "std-normalize-max-rl",
        PRIME_TABLES["max_rl"] + "[orchestrator.advantage]\nstd_normalize = true\n",
        (),
        "orchestrator.advantage.std_normalize",
        "grpo / echo",
    ),
    (
        "reward-clip-opd",
        PRIME_TABLES["opd"] + "[orchestrator.advantage]\nreward_clip = 1.0\n",
        (),
        "orchestrator.advantage.reward_clip",
        "without rewards",
    ),
    (
        "two-length-penalties",
        "[orchestrator.algo.length_penalty]\n[orchestrator.advantage]\nlength_penalty = 0.1\n",
        (),
        "orchestrator.advantage.length_penalty",
        "conflicts",
    ),
]


@pytest.mark.parametrize(
    ("extra", "flags", "path", "fragment"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED]
)
def test_refused_in_one_line(
    extra: str, flags: tuple[str, ...], path: str, fragment: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError) as e:
        config(tmp_path, extra, *flags)
    assert e.value.path == path, str(e.value)
    assert fragment in e.value.message and "\n" not in str(e.value), str(e.value)
