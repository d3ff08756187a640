"""A Hub id that exists only in a local Hugging Face cache, with HF_HUB_OFFLINE=1 (no network).
A run that trains from such an id is test_seed_metrics.py's demo run (one run checked by both)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.models.hub import seed_cache

REPO = Path(__file__).resolve().parents[2]
HUB_ID = "tiny-org/tiny-qwen3"


def _offline_env(hf_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}


def _hpcrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "hpcrl.cli", *args]


def test_unknown_hub_id_offline_fails_in_one_line(tmp_path: Path) -> None:
    r = subprocess.run(
        _hpcrl(
            "run",
            str(REPO / "configs/demo/rl.toml"),
            "--model.name",
            "tiny-org/absent",
            "--output-dir",
            str(tmp_path / "run"),
        ),
        capture_output=True,
        text=True,
        env=_offline_env(tmp_path / "hf"),
        timeout=120,
    )
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: model.name: 'tiny-org/absent'"), r.stderr


def test_submit_renders_an_offline_job_reading_the_submitters_cache(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    hf_home = tmp_path / "hf"
    seed_cache(tiny_model_dir, HUB_ID, hf_home / "hub")
    out = tmp_path / "run"
    r = subprocess.run(
        _hpcrl(
            "submit",
            str(REPO / "configs/demo/rl.toml"),
            "--model.name",
            HUB_ID,
            "--nodes",
            "2",
            "--slurm.gpus-per-node",
            "0",
            "--dry-run",
            "--output-dir",
            str(out),
        ),
        capture_output=True,
        text=True,
        env=_offline_env(hf_home),
        timeout=120,
    )
    assert r.returncode in (0, 1), r.stderr  # 1: a local sbatch --test-only may reject the partition
    from hpcrl.paths import RunPaths

    script = (RunPaths(out).slurm_dir / "hetjob.sbatch").read_text()
    assert "export HF_HUB_OFFLINE=1" in script and f"export HF_HUB_CACHE={hf_home / 'hub'}" in script


def test_job_env_downloads_every_hub_id_first(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpcrl.errors import ConfigError
    from hpcrl.launch.checks import load
    from hpcrl.models import hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the "download" is a cache lookup here: no network
    cache = tmp_path / "hub"
    monkeypatch.setattr(hub, "_cache_location", lambda: str(cache))
    seed_cache(tiny_model_dir, HUB_ID, cache)
    calls: list[str] = []
    real = hub.resolve_hub
    monkeypatch.setattr(
        hub, "resolve_hub", lambda n, **kw: calls.append(n) or real(n, cache_dir=str(cache), **kw)
    )
    cfg = load(["--model.name", HUB_ID], require_envs=False).config
    assert hub.job_env(cfg, download=True) == {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    assert calls == [HUB_ID]  # once, although every section names it
    cfg = load(["--model.name", "tiny-org/absent"], require_envs=False).config
    with pytest.raises(ConfigError, match="model.name: 'tiny-org/absent'"):
        hub.job_env(cfg, download=True)
