"""The trainer's Checkpointer and typed Progress: what is due, real saves and restores of a tiny model,
COMPLETE written by the background finaliser, retention sparing a step whose finaliser waits, and
checkpoints written with the old progress dicts (SFT's num_* names) still loading."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from hpcrl import checkpoint as ck
from hpcrl.config.schema import CkptConfig, TrainerModelConfig
from hpcrl.models.spec import load_model
from hpcrl.models.tokenizer import load_tokenizer
from hpcrl.paths import RunPaths
from hpcrl.trainer import optim, precision
from hpcrl.trainer.checkpointer import Checkpointer
from hpcrl.trainer.core import Progress, StepResult
from hpcrl.trainer.parallel import DistEnv
from hpcrl.trainer.setup import Training
from hpcrl.trainer.state import save_trainer_state

CURSOR = {"epoch": 1, "offset": 24, "num_rows": 180, "seed": 0}


def _training(model_dir: Path) -> Training:
    model = load_model(model_dir)
    opt = optim.build_optimizer(model, "adamw", lr=1e-3)
    return Training(
        model,
        load_tokenizer(model_dir),
        opt,
        optim.build_scheduler(opt, "constant"),
        torch.device("cpu"),
        str(model_dir),
        DistEnv(0, 1, 0, "127.0.0.1", 0),
        precision.of_model(TrainerModelConfig(), on_gpu=False),
    )


def _result(tokens: int, samples: int, skipped: bool = False) -> StepResult:
    return StepResult(
        stats={"loss": 1.0},
        grad_norm=1.0,
        lr=1e-3,
        skipped=skipped,
        time_fb=0.1,
        micro_batches=1,
        padding=0.0,
        slots_per_token=1.0,
        entropies=torch.zeros(0),
        tokens=tokens,
        samples=samples,
    )


@pytest.fixture
def paths(tmp_path: Path) -> RunPaths:
    p = RunPaths(tmp_path / "run")
    p.make_dirs()
    return p


def test_progress_advances_with_one_set_of_counter_names() -> None:
    p = Progress().advance(_result(100, 8)).advance(_result(50, 4, skipped=True), truncated=2, data=CURSOR)
    assert p == Progress(
        step=2, total_tokens=150, total_samples=12, total_truncated=2, skipped_updates=1, data=CURSOR
    )
    assert Progress.from_saved(p.to_saved()) == p
    # SFT checkpoints before the shared Progress used num_*; RL ones already used total_*.
    old_sft = {
        "step": 3,
        "num_samples": 24,
        "num_tokens": 700,
        "num_truncated": 1,
        "skipped_updates": 0,
        "data": CURSOR,
    }
    assert Progress.from_saved(old_sft) == Progress(
        step=3, total_tokens=700, total_samples=24, total_truncated=1, data=CURSOR
    )
    old_rl = {"step": 5, "total_tokens": 900, "total_samples": 40, "skipped_updates": 2}
    assert Progress.from_saved(old_rl) == Progress(
        step=5, total_tokens=900, total_samples=40, skipped_updates=2
    )


def test_what_is_due(tiny_model_dir: Path, paths: RunPaths) -> None:
    tr = _training(tiny_model_dir)
    c = Checkpointer(CkptConfig(interval=2), paths, tr, max_steps=5)
    assert [s for s in range(1, 6) if c.due(s)] == [2, 4, 5]  # every interval and the final step
    assert c.due(3, force=True)  # a stop signal or an early stop
    c.last_saved = 4
    assert not c.due(4) and not c.due(4, force=True)  # never the same step twice
    assert not Checkpointer(None, paths, tr, max_steps=5).due(5, force=True)
    assert [s for s in range(1, 6) if Checkpointer(CkptConfig(), paths, tr, max_steps=5).due(s)] == [5]


@pytest.mark.parametrize(
    "saved",
    [
        {
            "step": 2,
            "num_samples": 16,
            "num_tokens": 900,
            "num_truncated": 1,
            "skipped_updates": 0,
            "data": CURSOR,
        },
        {"step": 2, "total_tokens": 900, "total_samples": 16, "skipped_updates": 0},
    ],
    ids=["old-sft", "old-rl"],
)
def test_checkpoint_with_an_old_progress_dict_still_restores(
    tiny_model_dir: Path, paths: RunPaths, saved: dict
) -> None:
    tr = _training(tiny_model_dir)
    ck.begin_part(paths, 2, "trainer")
    save_trainer_state(paths, 2, 0, 1, tr.model, tr.optimizer, tr.scheduler, saved)  # as the old trainers did
    ck.mark_part_done(paths, 2, "trainer", rank=0)
    ck.write_complete(paths, 2, ("trainer",))
    fresh = _training(tiny_model_dir)
    step, progress = Checkpointer(CkptConfig(resume_step=-1), paths, fresh, 4, parts=("trainer",)).restore(
        Progress()
    )
    assert step == 2
    assert (progress.step, progress.total_samples, progress.total_tokens) == (2, 16, 900)
    assert progress.data == saved.get("data")
    assert progress.total_truncated == saved.get("num_truncated", 0)


def test_save_restore_roundtrip_and_complete_last(tiny_model_dir: Path, paths: RunPaths) -> None:
    tr = _training(tiny_model_dir)
    c = Checkpointer(CkptConfig(interval=1), paths, tr, 3, parts=("trainer",), finalize_timeout_s=30)
    progress = Progress().advance(_result(10, 2), data=CURSOR)
    assert c.maybe_save(1, progress) > 0 and c.maybe_save(1, progress, force=True) == 0.0
    c.close()
    assert ck.verify(paths, 1) is None and (paths.weights_dir(1) / "config.json").is_file()
    step, restored = Checkpointer(CkptConfig(resume_step=1), paths, _training(tiny_model_dir), 3).restore(
        Progress()
    )
    assert (step, restored) == (1, progress)


def test_retention_spares_a_step_whose_finaliser_is_waiting(tiny_model_dir: Path, paths: RunPaths) -> None:
    """Fast steps: step 6 completes (keep_last = 1) while step 5 still waits for the orchestrator's
    part. Step 5 must survive until its own finaliser is done; then it is an ordinary old step."""
    tr = _training(tiny_model_dir)
    c = Checkpointer(CkptConfig(interval=1, keep_last=1), paths, tr, 10, finalize_timeout_s=60)
    c.save(5, Progress(step=5))
    c.save(6, Progress(step=6))
    ck.begin_part(paths, 6, "orchestrator")
    ck.mark_part_done(paths, 6, "orchestrator")
    deadline = time.monotonic() + 30
    while not paths.complete_file(6).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    while c.finalizing() != {5} and time.monotonic() < deadline:  # step 6's finaliser ends after
        time.sleep(0.05)  # COMPLETE, with its retention pass
    assert ck.verify(paths, 6) is None
    assert paths.checkpoint_dir(5).is_dir() and c.finalizing() == {5}
    ck.begin_part(paths, 5, "orchestrator", clear=True)
    ck.mark_part_done(paths, 5, "orchestrator")
    c.close()
    assert c.finalizing() == set()
    assert ck.list_steps(paths) == [6] and not paths.weights_dir(5).exists()  # complete, older than keep_last


def test_a_refused_checkpoint_is_retried_afresh_and_past_the_bound_ends_in_one_line(
    tiny_model_dir: Path, paths: RunPaths, caplog
) -> None:
    """checkpoints/ unwritable (chattr +i as root: a real refusal) for 1 s while step 2 is saved: named
    once, retried, complete. Then unwritable for good with storage_timeout_s = 0.5: one line naming
    the path and the field; step 2 stays the checkpoint a resume takes."""
    import logging
    import subprocess
    import threading

    from hpcrl.storage import WriteRefused
    from tests.integration.faults import _make_unwritable

    tr = _training(tiny_model_dir)
    c = Checkpointer(
        CkptConfig(interval=1), paths, tr, 5, parts=("trainer",), finalize_timeout_s=30, storage_timeout_s=60
    )
    _, undo = _make_unwritable(paths.checkpoints_dir)
    clear = threading.Timer(1.0, lambda: subprocess.run(undo, check=True))
    try:
        clear.start()
        with caplog.at_level(logging.WARNING, "hpcrl.storage"):
            c.save(2, Progress(step=2))
            c.close()
        lines = [r.getMessage() for r in caplog.records]
        assert (
            lines[0].startswith("trainer: cannot write checkpoint step 2: not writable (") and len(lines) == 2
        )
        assert str(paths.checkpoints_dir) in lines[0] and "storage_timeout_s" in lines[0]
        assert ck.verify(paths, 2) is None
        _make_unwritable(paths.checkpoints_dir)
        c.storage_timeout_s = 0.5
        with pytest.raises(WriteRefused) as got:
            c.save(3, Progress(step=3))
        assert str(paths.checkpoint_dir(3)) in str(got.value) and str(got.value).endswith(
            "(storage_timeout_s = 0.5)"
        )
    finally:
        clear.cancel()
        subprocess.run(undo, check=False)
    c.close()
    assert ck.latest_complete(paths) == 2 and not paths.complete_file(3).exists()
