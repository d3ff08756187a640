"""Each role's model section holds only what that role reads (hpcrl/config/sections/model.py).

Generated from the per-role classes: every field of one role's model section set in another role's
section is refused in one line naming the role that reads it; [model] fields flow field by field
into every role that has them, and a role's own value wins.
"""

from __future__ import annotations

import pytest

from hpcrl.cli import main
from hpcrl.config import ConfigError
from hpcrl.config.resolved import to_dict
from hpcrl.config.sections.model import ROLE_MODELS
from hpcrl.launch.checks import load

BASE = ["--model.name", "hpcrl/tiny-qwen3", "--orchestrator.train.env", '[{id = "reverse-text"}]']
SAMPLE = {"dtype": "float32", "trust_remote_code": "true", "max_lora_rank": "8", "ep": "2"}


def _foreign() -> list[tuple[str, str, list[str]]]:
    """(role, field, roles that own the field) for every field a role's section lacks."""
    every = {f for cls in ROLE_MODELS.values() for f in cls.__struct_fields__}
    out = []
    for role, cls in ROLE_MODELS.items():
        for field in sorted(every - set(cls.__struct_fields__)):
            owners = [r for r, c in ROLE_MODELS.items() if field in c.__struct_fields__]
            out.append((role, field, owners))
    return out


# prime-rl's [orchestrator.model.lora] (the served adapter's name, rank, alpha) is translated on load:
# tests/unit/test_prime_shapes.py::test_orchestrator_lora_table
FOREIGN = [f for f in _foreign() if f[:2] != ("orchestrator", "lora")]


def test_the_split_is_real():
    assert {"ep", "lora", "attn", "impl", "activation_checkpointing", "optimization_dtype"} <= {
        f for r, f, _ in FOREIGN if r == "inference"
    }
    assert ("orchestrator", "dtype", ["trainer", "inference"]) in FOREIGN


@pytest.mark.parametrize("role,field,owners", FOREIGN, ids=[f"{r}.model.{f}" for r, f, _ in FOREIGN])
def test_a_field_another_role_reads_is_refused_naming_it(tmp_path, role, field, owners):
    toml = tmp_path / "x.toml"
    value = {"lora": "{rank = 4}", "impl": '"hf"', "attn": '"sdpa"'}.get(field, "true")
    if field in ("dtype", "optimization_dtype", "reduce_dtype"):
        value = '"float32"'
    elif field in ("ep", "max_lora_rank"):
        value = "2"
    toml.write_text(f"[{role}.model]\n{field} = {value}\n")
    with pytest.raises(ConfigError) as e:
        load([*BASE, str(toml)])
    assert e.value.path == f"{role}.model.{field}"
    assert f"{owners[0]} field" in e.value.message or f"{' / '.join(owners)} field" in e.value.message


def test_flags_are_refused_the_same_way(capsys):
    assert main(["run", *BASE, "--inference.model.ep", "2", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "config error: inference.model.ep: the inference role does not read it; it is a trainer"
    )


def test_model_fields_flow_field_by_field():
    cfg = load(
        [
            *BASE,
            "--model.dtype",
            "bfloat16",
            "--model.activation-checkpointing",
            "--inference.model.dtype",
            "float32",
        ]
    ).config
    assert cfg.trainer.model.dtype == "bfloat16" and cfg.trainer.model.activation_checkpointing
    assert cfg.inference.model.dtype == "float32"  # the role's own value wins
    assert cfg.orchestrator.model.name == "hpcrl/tiny-qwen3"
    d = to_dict(cfg)
    assert d["inference"]["model"] == {"dtype": "float32"}  # what flowed is written once, in [model]
    assert "model" not in d["trainer"] and "model" not in d["orchestrator"]


def test_servers_serve_the_trained_adapter_rank():
    cfg = load([*BASE, "--model.lora.rank", "8"]).config
    assert cfg.trainer.model.lora.rank == 8 and cfg.inference.model.max_lora_rank == 8
    # restated in the inference role's file: `hpcrl inference` skips [trainer] when it loads it
    assert to_dict(cfg)["inference"]["model"] == {"max_lora_rank": 8}


def test_a_role_that_samples_nothing_takes_a_short_seq_len(capsys):
    """max_tokens (128 by default) longer than seq_len refuses a run: the orchestrator could not fit a
    completion. A trainer or an inference server alone samples nothing; theirs is only the length."""
    short = ["--model.name", "hpcrl/tiny-qwen3", "--seq-len", "64", "--dry-run"]
    assert main(["trainer", *short]) == 0
    assert main(["inference", *short]) == 0
    capsys.readouterr()
    assert main(["run", *short, "--orchestrator.train.env", '[{id = "reverse-text"}]']) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "config error: orchestrator.train.sampling.max_tokens: 128 is longer than seq_len (64)"
    )
