"""No silent no-ops: a parsed field that nothing implements is rejected when set, naming itself."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from hpcrl.config import ConfigError
from hpcrl.launch.checks import load

BASE = ["--model.name", "hpcrl/tiny-qwen3", "--orchestrator.train.env", '[{id = "reverse-text"}]']

# (flag path as the user writes it, a value nothing implements, the field the error must name)
# (inference.parallel.dp, once here, is vLLM's data_parallel_size now: tests/unit/test_vllm_table.py)
REJECTED: list[tuple[str, str, str]] = []
ACCEPTED = [
    ("model.impl", "hf"),
    ("model.impl", "auto"),
    ("model.ep", "1"),
    ("model.impl", "custom"),
    ("trainer.model.impl", "custom"),
    ("trainer.model.ep", "8"),
    ("inference.parallel.dp", "1"),
    ("orchestrator.trajectory_strategy", "interleaved"),
    ("orchestrator.trajectory_strategy", "branching"),
    ("orchestrator.renderer.name", "default"),
]


def _flag(path: str) -> str:
    return "--" + path.replace("_", "-")


@pytest.mark.parametrize(("path", "value", "named"), REJECTED, ids=[r[0] for r in REJECTED])
def test_unimplemented_field_is_rejected_naming_it(path: str, value: str, named: str) -> None:
    with pytest.raises(ConfigError) as e:
        load([*BASE, _flag(path), value])
    assert e.value.path == named
    line = e.value.one_line()
    assert "not supported yet" in line and repr(value if not value.isdigit() else int(value)) in line


@pytest.mark.parametrize(("path", "value"), ACCEPTED, ids=[f"{p}={v}" for p, v in ACCEPTED])
def test_default_values_are_accepted(path: str, value: str) -> None:
    load([*BASE, _flag(path), value])


def test_sft_rejects_them_too(tmp_path: Path) -> None:
    from hpcrl.config.schema import SFTConfig

    with pytest.raises(ConfigError, match=r"^orchestrator|^inference|is not supported yet|unknown"):
        load(
            ["--model.name", "hpcrl/tiny-qwen3", "--data.name", "x.jsonl", "--inference.parallel.dp", "4"],
            root=SFTConfig,
        )


def test_every_table_row_is_a_real_field() -> None:
    """The table may not name a field the schema lost (the check would silently never fire)."""
    from hpcrl.config.schema import Config
    from hpcrl.config.validate import UNSUPPORTED, _get

    cfg = load(BASE).config
    assert isinstance(cfg, Config)
    for path, allowed, _ in UNSUPPORTED:
        present, value = _get(cfg, path)
        assert present and value in allowed, path


def test_adapter_interval_needs_lora_and_writes_adapters(tiny_model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^ckpt\.adapter_interval: 2 needs LoRA"):
        load([*BASE, "--ckpt.adapter-interval", "2"])
    from hpcrl.models.load import LoraParams
    from hpcrl.models.spec import load_model
    from hpcrl.paths import RunPaths
    from hpcrl.trainer.checkpointer import Checkpointer

    cfg = load([*BASE, "--model.lora", "--ckpt.adapter-interval", "2"]).config
    tr = SimpleNamespace(
        model=load_model(tiny_model_dir, lora=LoraParams(rank=2)), dist=SimpleNamespace(rank=0)
    )
    paths = RunPaths(tmp_path)
    ckpt = Checkpointer(cfg.ckpt, paths, tr, max_steps=5)
    written = [s for s in range(1, 6) if ckpt.maybe_save_adapter(s)]
    assert written == [2, 4, 5]  # every 2 steps and the final one
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["step_2", "step_4", "step_5"]
    assert (paths.adapter_dir(4) / "adapter_model.safetensors").is_file()
    assert (paths.adapter_dir(4) / "adapter_config.json").is_file()
