"""A deterministic resume from checkpoint N reloads policies N - max_async_level .. N - 1; the trainer
keeps them only for its newest intact checkpoint. Resuming an older checkpoint whose old policies are
gone is refused before anything moves, in one line naming ckpt.resume_step (hpcrl/launch/restart.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.bus import PolicyReady, write_message
from hpcrl.errors import ConfigError
from hpcrl.launch.checks import load
from hpcrl.launch.restart import check_old_policies
from hpcrl.paths import RunPaths


def config(tmp_path: Path, *flags: str):
    return load(
        ["configs/demo/rl.toml", "--output-dir", str(tmp_path / "run"), *flags], require_envs=False
    ).config


def announce(paths: RunPaths, step: int, weights: bool = True) -> None:
    d = paths.broadcast_dir(step)
    if weights:
        d.mkdir(parents=True, exist_ok=True)
    msg = PolicyReady(step=step, transport="filesystem", path=str(d), checksum="x", num_params=1, num_bytes=1)
    write_message(paths.policy_file(step), msg, durable=False)


@pytest.fixture
def paths(tmp_path: Path) -> RunPaths:
    p = RunPaths(tmp_path / "run")
    p.make_dirs()
    return p


def test_kept_policies_pass(tmp_path: Path, paths: RunPaths) -> None:
    cfg = config(tmp_path, "--deterministic", "true", "--orchestrator.max-async-level", "2")
    for s in (8, 9):
        announce(paths, s)
    check_old_policies(cfg, paths, 10)  # needs 8 and 9: both there


@pytest.mark.parametrize("gone", ["announcement", "weights"])
def test_a_pruned_policy_is_one_line_naming_resume_step(tmp_path: Path, paths: RunPaths, gone: str) -> None:
    cfg = config(tmp_path, "--deterministic", "true", "--orchestrator.max-async-level", "2")
    announce(paths, 9)
    if gone == "weights":
        announce(paths, 8, weights=False)
    with pytest.raises(ConfigError) as e:
        check_old_policies(cfg, paths, 10)
    msg = str(e.value)
    assert "ckpt.resume_step" in msg and "policy 8" in msg and "\n" not in msg


def test_not_deterministic_or_no_lag_needs_nothing(tmp_path: Path, paths: RunPaths) -> None:
    check_old_policies(config(tmp_path, "--orchestrator.max-async-level", "2"), paths, 10)
    check_old_policies(
        config(tmp_path, "--deterministic", "true", "--orchestrator.max-async-level", "0"), paths, 10
    )


def _checkpoint(paths: RunPaths, step: int, parts: tuple[str, ...] = ("trainer", "orchestrator")) -> None:
    from hpcrl import checkpoint as ck

    for part in parts:
        ck.begin_part(paths, step, part)
        ck.mark_part_done(paths, step, part)
    if len(parts) == 2:
        ck.write_complete(paths, step)


@pytest.mark.parametrize("resume", [True, False])
def test_a_restart_takes_away_the_dead_launchs_newer_checkpoint_dirs(
    tmp_path: Path, paths: RunPaths, resume: bool, capsys
) -> None:
    """`hpcrl resume --step -1` after a kill that left step 3's orchestrator part DONE (the orchestrator
    runs ahead): step_3 goes, so the resumed trainer's part of it is never finalized with the dead
    launch's. A fresh run in the used directory keeps nothing of the old run's checkpoints in place
    (a later resume would pick the old run's newest); complete ones are moved aside, not deleted."""
    from hpcrl import checkpoint as ck
    from hpcrl.launch.restart import prepare_resume

    _checkpoint(paths, 2)
    _checkpoint(paths, 3, parts=("orchestrator",))
    flags = ["--ckpt.resume-step", "-1"] if resume else []
    args = prepare_resume(config(tmp_path, *flags), paths)
    out = capsys.readouterr().out
    assert "step_3 (incomplete) removed" in out
    if resume:
        assert args == ["--ckpt.resume-step", "2"] and ck.list_steps(paths) == [2]
    else:
        assert args == [] and ck.list_steps(paths) == []
        (aside,) = paths.checkpoints_dir.glob("moved_aside/*/step_2")
        assert (aside / "COMPLETE").is_file() and "step_2 moved to" in out
