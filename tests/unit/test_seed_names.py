"""Every name the seed documents use (tests/seed_names.toml), one test each: config tables and flags
load and land where the check says, metric names and log file names are documented. Metric names
are checked against real runs by the tests each entry's `when` names (see the list's header)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest

from hpcrl.config.loader import load
from hpcrl.config.schema import Config, SFTConfig
from tests.conftest import rl_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
NAMES = tomllib.loads((ROOT / "tests" / "seed_names.toml").read_text())
OBSERVABILITY = (ROOT / "docs" / "observability.md").read_text()
WHEN = {"rl-cpu", "sft-cpu", "sft-val", "moe", "gpu"}
SFT_BASE = 'max_steps = 2\n[model]\nname = "hpcrl/tiny-qwen3"\n[data]\nname = "data.jsonl"\n'


def _entries(kind: str) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{e['seed']}-{i}", e) for i, e in enumerate(NAMES.get(kind, []))]


def _load(entry: dict[str, Any], tmp_path: Path, argv: list[str]) -> Any:
    root = entry.get("root", "rl")
    files = []
    if entry.get("base", True):
        base = tmp_path / "base.toml"
        base.write_text(SFT_BASE if root == "sft" else rl_toml(2, seq_len=2048, max_tokens=16))
        files.append(str(base))
    if "toml" in entry:
        own = tmp_path / "seed.toml"
        own.write_text(entry["toml"])
        files.append(str(own))
    loaded = load([*files, *argv], SFTConfig if root == "sft" else Config)
    c = loaded.config
    if "check" in entry:
        assert eval(entry["check"], {}, {"c": c}), entry["check"]  # noqa: S307 - our own test data
    if "note" in entry:
        assert any(entry["note"] in n for n in loaded.notes), (entry["note"], loaded.notes)
    return c


@pytest.mark.parametrize("entry", [e for _, e in _entries("config")], ids=[i for i, _ in _entries("config")])
def test_seed_config_loads(entry: dict[str, Any], tmp_path: Path) -> None:
    _load(entry, tmp_path, [])


@pytest.mark.parametrize("entry", [e for _, e in _entries("flag")], ids=[i for i, _ in _entries("flag")])
def test_seed_flag_loads(entry: dict[str, Any], tmp_path: Path) -> None:
    _load(entry, tmp_path, list(entry["argv"]))


METRICS = [(e["seed"], e["when"], n) for e in NAMES["metric"] for n in e["names"]]


def _expand(text: str) -> set[str]:
    """`a/{all,<env>}/{mean,std}` -> the four names it stands for (brace groups, nested left to right)."""
    m = re.search(r"\{([^{}]*)\}", text)
    if m is None:
        return {text}
    return {x for alt in m.group(1).split(",") for x in _expand(text[: m.start()] + alt + text[m.end() :])}


_PROSE = re.sub(r"```.*?```", "", OBSERVABILITY, flags=re.S)  # code blocks hold no metric names
DOCUMENTED = {name for span in re.findall(r"`([^`\n]+)`", _PROSE) for name in _expand(span)}


@pytest.mark.parametrize("seed,when,name", METRICS, ids=[f"{s}:{n}" for s, _, n in METRICS])
def test_seed_metric_is_documented(seed: str, when: str, name: str) -> None:
    assert when in WHEN, f"unknown when = {when!r}"
    shown = name.replace("{env}", "<env>").replace("{k}", "k").replace("{subset}", "<subset>")
    assert shown in DOCUMENTED, f"{shown} is not in docs/observability.md"


LOGS = [(e["seed"], n) for e in NAMES["log_file"] for n in e["names"]]


@pytest.mark.parametrize("seed,name", LOGS, ids=[f"{s}:{n}" for s, n in LOGS])
def test_seed_log_file_is_documented(seed: str, name: str) -> None:
    assert name in OBSERVABILITY, f"{name}: seed {seed}'s log file is not in docs/observability.md"


def rl_cpu_metric_names(env: str, k: int) -> dict[str, set[str]]:
    """{role: names} of the rl-cpu entries for one env and eval k (test_seed_metrics reads it)."""
    out: dict[str, set[str]] = {}
    for e in NAMES["metric"]:
        if e["when"] == "rl-cpu":
            out.setdefault(e["role"], set()).update(n.format(env=env, k=k) for n in e["names"])
    return out


def sft_cpu_metric_names(subset: str) -> set[str]:
    return {n.format(subset=subset) for e in NAMES["metric"] if e["when"] == "sft-cpu" for n in e["names"]}
