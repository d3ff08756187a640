"""The trainer's precision (hpcrl/trainer/precision.py): defaults per device, combinations that make no
sense rejected in one line naming the field, and what --dry-run shows."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.config import ConfigError
from hpcrl.launch.checks import load
from hpcrl.trainer.precision import resolve

BASE = ["--model.name", "hpcrl/tiny-qwen3", "--orchestrator.train.env", '[{id = "reverse-text"}]']

# (dtype, optimization_dtype, reduce_dtype, on_gpu) -> (compute, master, reduce, mixed)
RESOLVED = [
    (
        ("auto", "float32", "float32", True),
        ("bfloat16", "float32", "float32", True),
    ),  # GPU default: bf16-mixed
    (("auto", "float32", "float32", False), ("float32", "float32", "float32", False)),  # CPU default: fp32
    (("bfloat16", "float32", "float32", False), ("bfloat16", "float32", "float32", True)),  # asked for on CPU
    (("bfloat16", "float32", "bfloat16", True), ("bfloat16", "float32", "bfloat16", True)),
    (("auto", "bfloat16", "float32", False), ("bfloat16", "bfloat16", "float32", False)),  # pure bf16 weights
    (("bfloat16", "bfloat16", "bfloat16", True), ("bfloat16", "bfloat16", "bfloat16", False)),
    (
        ("float32", "float32", "float32", True),
        ("float32", "float32", "float32", False),
    ),  # fp32 on GPU if asked
]


@pytest.mark.parametrize(("given", "want"), RESOLVED, ids=["-".join(map(str, g)) for g, _ in RESOLVED])
def test_resolve(given: tuple, want: tuple) -> None:
    p = resolve(*given)
    assert (p.compute, p.master, p.reduce, p.mixed) == want


def test_describe() -> None:
    assert resolve("auto", "float32", "float32", on_gpu=False).describe() == "fp32 (no mixed precision)"
    assert resolve("auto", "float32", "float32", on_gpu=True).describe() == (
        "bf16-mixed: bf16 compute over fp32 master weights + optimizer state, fp32 gradient reduce, "
        "bf16 policy published"
    )


# (flags, the field the error must name, a phrase of the message)
REJECTED = [
    (["--model.dtype", "float16"], "model.dtype", "needs loss scaling"),
    (["--trainer.model.dtype", "float16"], "trainer.model.dtype", "needs loss scaling"),
    (
        ["--model.dtype", "float32", "--model.optimization-dtype", "bfloat16"],
        "model.optimization_dtype",
        "gain nothing",
    ),
    (["--model.dtype", "float32", "--model.reduce-dtype", "bfloat16"], "model.reduce_dtype", "round"),
    (
        ["--trainer.model.dtype", "float32", "--trainer.model.reduce-dtype", "bfloat16"],
        "trainer.model.reduce_dtype",
        "round",
    ),
]


@pytest.mark.parametrize(
    ("flags", "named", "phrase"), REJECTED, ids=[r[1] + "-" + r[0][-1] for r in REJECTED]
)
def test_nonsense_combinations_are_one_line_errors(flags: list[str], named: str, phrase: str) -> None:
    with pytest.raises(ConfigError) as e:
        load([*BASE, *flags])
    assert e.value.path == named
    assert phrase in e.value.one_line() and "\n" not in e.value.one_line()


def test_unknown_optimization_dtype_is_rejected() -> None:
    with pytest.raises(ConfigError, match="optimization_dtype"):
        load([*BASE, "--model.optimization-dtype", "float16"])


def test_sft_checks_precision_too(tmp_path: Path) -> None:
    from hpcrl.config.schema import SFTConfig

    with pytest.raises(ConfigError) as e:
        load(
            [
                "--model.name",
                "hpcrl/tiny-qwen3",
                "--data.name",
                str(tmp_path / "d.jsonl"),
                "--model.dtype",
                "float16",
            ],
            root=SFTConfig,
        )
    assert e.value.path == "model.dtype"


def test_dry_run_shows_precision_and_rejects_what_the_device_makes_nonsense(tmp_path: Path, capsys) -> None:
    from hpcrl.cli import main

    args = ["run", *BASE, "--output-dir", str(tmp_path / "o"), "--dry-run"]
    assert main(args) == 0
    assert "precision:    fp32 (no mixed precision)" in capsys.readouterr().out  # CPU machine
    assert main([*args, "--model.dtype", "bfloat16"]) == 0
    assert "precision:    bf16-mixed: bf16 compute over fp32 master weights" in capsys.readouterr().out
    # valid on GPU (auto = bf16 there), nonsense on this CPU: fp32 gradients rounded to bf16 to reduce
    assert main([*args, "--model.reduce-dtype", "bfloat16"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "config error: model.reduce_dtype: 'bfloat16' would round 'float32' gradients "
        "only to reduce them; use 'float32' (or dtype = 'bfloat16' for bf16 compute)"
    ]
