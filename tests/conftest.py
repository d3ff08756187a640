"""Shared fixtures: a tiny model built once per session, and a fresh run directory per test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 model + tokenizer (HF directory), built locally once per test session."""
    from hpcrl.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_model"), preset="tiny", seed=0)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """An empty run output directory with the standard layout (RunPaths.make_dirs)."""
    from hpcrl.paths import RunPaths

    root = tmp_path / "run"
    RunPaths(root).make_dirs()
    return root


@pytest.fixture(autouse=True, scope="session")
def _hpcrl_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Built-in model names resolve into a per-session cache, never the user's ~/.cache."""
    if "HPCRL_CACHE" not in os.environ:
        os.environ["HPCRL_CACHE"] = str(tmp_path_factory.mktemp("hpcrl_cache"))
