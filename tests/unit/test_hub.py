"""Hub ids resolve through a local Hugging Face cache (no network: HF_HUB_OFFLINE=1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.errors import ConfigError
from hpcrl.models.hub import hub_ids, resolve_hub, seed_cache


def test_hub_id_resolves_from_the_cache_offline(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    snap = seed_cache(tiny_model_dir, "tiny-org/tiny-qwen3", cache)
    got = resolve_hub("tiny-org/tiny-qwen3", cache_dir=str(cache))
    assert Path(got) == Path(snap) and (Path(got) / "config.json").is_file()
    from hpcrl.models.spec import load_model
    from hpcrl.models.tokenizer import load_tokenizer

    assert load_model(got) is not None and load_tokenizer(got) is not None


@pytest.mark.parametrize(
    ("name", "field"),
    [("no-org/missing-model", "model.name"), ("no-org/missing-model", "inference.model.name")],
)
def test_unknown_hub_id_offline_is_one_line_naming_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, field: str
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError) as e:
        resolve_hub(name, field=field, cache_dir=str(tmp_path))
    line = e.value.one_line()
    assert line.startswith(f"config error: {field}: ") and name in line and "HF_HUB_OFFLINE=1" in line
    assert "\n" not in str(e.value)


def test_invalid_name_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from hpcrl.models.resolve import resolve_model

    with pytest.raises(
        ConfigError, match=r"model\.name: .*not a local directory|model\.name: .*valid Hub id"
    ):
        resolve_model("./no/such/dir//x")


def test_hub_ids_lists_only_what_needs_downloading(tiny_model_dir: Path) -> None:
    from hpcrl.launch.checks import load

    def cfg(*flags: str):
        return load(list(flags), require_envs=False).config

    ids = hub_ids(cfg("--model.name", "org/policy"))  # the shared name flows into every section
    assert ids["model.name"] == "org/policy" and set(ids.values()) == {"org/policy"}
    assert hub_ids(cfg("--model.name", str(tiny_model_dir))) == {}
    assert hub_ids(cfg("--model.name", "hpcrl/tiny-qwen3")) == {}
