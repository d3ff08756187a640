"""[orchestrator.concurrency] (issue 53): bad values are one line naming the field; prime-rl's table
(no `mode`) means adaptive, min_inflight = max_inflight means fixed; the default stays fixed."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.cli import main
from hpcrl.config.loader import load
from hpcrl.config.schema import Config
from tests.conftest import rl_toml

BASE = rl_toml()
CONC = "[orchestrator.concurrency]\n"


def with_table(body: str) -> str:
    return BASE.replace("[orchestrator.train.sampling]", CONC + body + "[orchestrator.train.sampling]")


CASES = [
    ("min-above-max", with_table("min_inflight = 10\nmax_inflight = 5\n"), [], "orchestrator.concurrency", "exceeds max_inflight"),
    ("initial-above-max", with_table("initial_inflight = 9\nmax_inflight = 5\n"), [], "orchestrator.concurrency", "initial_inflight = 9"),
    ("bad-mode", with_table('mode = "auto"\n'), [], "orchestrator.concurrency.mode", "allowed: adaptive, fixed"),
    ("zero-poll", BASE, ["--orchestrator.concurrency.poll-interval-s", "0"], "orchestrator.concurrency.poll_interval_s", "> 0"),
    ("zero-max", with_table("max_inflight = 0\n"), [], "orchestrator.concurrency.max_inflight", ">= 1"),
    ("unknown-key", with_table("max_inflght = 3\n"), [], "orchestrator.concurrency.max_inflght", "unknown field"),
    ("kv-too-small", BASE, ["--inference.kv-cache-tokens", "64"], "inference.kv_cache_tokens", "max_model_len = 128"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("text", "flags", "path", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_concurrency_value_is_one_line(
    text, flags, path, fragment, tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(text)
    rc = main(["run", str(cfg), "--dry-run", "--output-dir", str(tmp_path / "out"), *flags])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"config error: {path}: ") and fragment in err, err


def _cfg(tmp_path: Path, text: str, *flags: str) -> Config:
    p = tmp_path / "c.toml"
    p.write_text(text)
    return load(["@", str(p), "--output-dir", str(tmp_path / "o"), *flags], Config, require_envs=False).config


def test_default_is_the_fixed_cap(tmp_path: Path) -> None:
    o = _cfg(tmp_path, BASE).orchestrator
    assert (o.concurrency.mode, o.max_concurrent) == ("fixed", 256)


def test_prime_rl_table_is_adaptive_and_min_equal_max_is_fixed(tmp_path: Path) -> None:
    c = _cfg(tmp_path, with_table("initial_inflight = 8\nmax_inflight = 96\n")).orchestrator.concurrency
    assert (c.mode, c.initial_inflight, c.max_inflight, c.min_inflight) == ("adaptive", 8, 96, 1)
    o = _cfg(tmp_path, with_table("min_inflight = 32\nmax_inflight = 32\n")).orchestrator
    assert (o.concurrency.mode, o.max_concurrent) == ("fixed", 32)
    o = _cfg(tmp_path, with_table('mode = "fixed"\nmax_inflight = 96\n')).orchestrator  # hpcrl's own shape
    assert (o.concurrency.mode, o.max_concurrent) == ("fixed", 256)
