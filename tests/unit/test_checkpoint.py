"""step_N checkpoints: COMPLETE written last, verification, newest-valid selection, retention."""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import pytest

from hpcrl import checkpoint as ck
from hpcrl.paths import RunPaths


def _save(paths: RunPaths, step: int, payload: bytes = b"weights") -> None:
    for part in ck.PARTS:
        d = ck.begin_part(paths, step, part)
        (d / "state.bin").write_bytes(payload + part.encode())
        ck.mark_part_done(paths, step, part)
    assert ck.finalize_when_ready(paths, step, ck.PARTS, trainer_ranks=None, timeout=1) is not None  # type: ignore[arg-type]


@pytest.fixture
def paths(tmp_path: Path) -> RunPaths:
    p = RunPaths(tmp_path / "run")
    p.make_dirs()
    return p


def test_complete_only_after_every_part(paths: RunPaths) -> None:
    d = ck.begin_part(paths, 3, "trainer")
    (d / "rank_0.json").write_text("{}")
    ck.mark_part_done(paths, 3, "trainer", rank=0)
    # The orchestrator part is missing: no COMPLETE, and the wait is bounded.
    assert ck.finalize_when_ready(paths, 3, ck.PARTS, trainer_ranks=1, timeout=0.3) is None
    assert ck.verify(paths, 3) == "no COMPLETE manifest"
    ck.begin_part(paths, 3, "orchestrator")
    ck.mark_part_done(paths, 3, "orchestrator")
    m = ck.finalize_when_ready(paths, 3, ck.PARTS, trainer_ranks=1, timeout=1)
    assert m is not None and {f.path for f in m.files} >= {"trainer/rank_0.json", "trainer/DONE.rank_0"}
    assert ck.verify(paths, 3) is None


def test_verify_catches_truncation_bitflip_and_garbage(paths: RunPaths) -> None:
    _save(paths, 1)
    f = paths.trainer_ckpt_dir(1) / "state.bin"
    data = f.read_bytes()
    f.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit flipped
    assert "checksum" in (ck.verify(paths, 1) or "")
    f.write_bytes(data[:3])
    assert "size" in (ck.verify(paths, 1) or "")
    paths.complete_file(1).write_bytes(b"\x00garbage")
    assert "corrupt" in (ck.verify(paths, 1) or "")


def test_latest_complete_skips_corrupt_newer_with_warning(
    paths: RunPaths, caplog: pytest.LogCaptureFixture
) -> None:
    _save(paths, 2)
    _save(paths, 4)
    (paths.trainer_ckpt_dir(4) / "state.bin").write_bytes(b"oops")
    ck.begin_part(paths, 6, "trainer")  # a crash mid-checkpoint: no COMPLETE
    with caplog.at_level(logging.WARNING):
        assert ck.latest_complete(paths) == 2
    assert "step_4" in caplog.text and "step_6" in caplog.text
    assert ck.resolve_resume_step(paths, -1) == 2
    with pytest.raises(ck.CheckpointError, match="step_4"):
        ck.resolve_resume_step(paths, 4)


def test_no_checkpoint_is_a_clear_error(paths: RunPaths) -> None:
    with pytest.raises(ck.CheckpointError, match="no complete checkpoint"):
        ck.resolve_resume_step(paths, -1)


@pytest.mark.parametrize(
    ("steps", "keep_last", "keep_interval", "expected"),
    [
        ([1, 2, 3, 4, 5], None, None, {1, 2, 3, 4, 5}),
        ([1, 2, 3, 4, 5], 2, None, {4, 5}),
        ([2, 4, 6, 8, 10], 1, 4, {4, 8, 10}),
        ([5], 3, 2, {5}),
    ],
)
def test_retention_keep(
    steps: list[int], keep_last: int | None, keep_interval: int | None, expected: set[int]
) -> None:
    assert ck.retention_keep(steps, keep_last, keep_interval) == expected


def test_apply_retention_deletes_outside_keep_set_and_stale_incomplete(paths: RunPaths) -> None:
    for s in (1, 2, 3, 4):
        _save(paths, s)
    ck.begin_part(paths, 0, "trainer")  # an old incomplete one
    removed = ck.apply_retention(paths, keep_last=2, keep_interval=None)
    assert sorted(removed) == [0, 1, 2]
    assert ck.list_steps(paths) == [3, 4]
    assert ck.verify(paths, 4) is None


def test_retention_spares_a_checkpoint_still_being_finalized(paths: RunPaths) -> None:
    """Fast steps: step 6 completes while step 5's finalizer still waits for the orchestrator's part.
    Retention must not delete step 5 under it (that hung the trainer at exit, caught by the
    reliability test); once 5 is no longer in progress, an older incomplete step goes as before."""
    for s in (3, 4, 6):
        _save(paths, s)
    ck.begin_part(paths, 5, "trainer")
    ck.mark_part_done(paths, 5, "trainer", rank=0)
    assert ck.apply_retention(paths, keep_last=2, keep_interval=None, in_progress={5}) == [3]
    assert ck.list_steps(paths) == [4, 5, 6]
    # the orchestrator's part arrives: step 5 finalizes, and is then an ordinary complete step
    ck.begin_part(paths, 5, "orchestrator")
    ck.mark_part_done(paths, 5, "orchestrator")
    assert ck.finalize_when_ready(paths, 5, ("trainer", "orchestrator"), 1, timeout=5) is not None
    assert ck.apply_retention(paths, keep_last=2, keep_interval=None) == [4]


def test_finalizer_gives_up_at_once_when_its_checkpoint_is_gone(paths: RunPaths) -> None:
    ck.begin_part(paths, 7, "trainer")
    shutil.rmtree(paths.checkpoint_dir(7))
    t0 = time.monotonic()
    assert ck.finalize_when_ready(paths, 7, ("trainer", "orchestrator"), 1, timeout=60) is None
    assert time.monotonic() - t0 < 30  # not the 60 s timeout


def test_begin_part_removes_stale_complete(paths: RunPaths) -> None:
    _save(paths, 5)
    ck.begin_part(paths, 5, "trainer")  # re-saving step 5 after a resume from an earlier step
    assert ck.verify(paths, 5) == "no COMPLETE manifest"


@pytest.mark.parametrize(
    ("step", "interval", "due"), [(5, None, False), (10, None, True), (4, 2, True), (5, 2, False)]
)
def test_is_due(step: int, interval: int | None, due: bool) -> None:
    assert ck.is_due(step, max_steps=10, interval=interval) is due


def test_newest_intact_falls_back_past_a_broken_complete_with_one_warning(
    paths: RunPaths, caplog: pytest.LogCaptureFixture
) -> None:
    """What bus retention protects (hpcrl.trainer.publish) is the checkpoint a resume would pick: a
    COMPLETE whose files are missing or cut short does not count, and is warned about once."""
    _save(paths, 2)
    _save(paths, 4)
    _save(paths, 6)
    seen: dict[int, tuple[int, str | None]] = {}
    assert ck.newest_intact(paths, seen) == 6
    (paths.trainer_ckpt_dir(6) / "state.bin").unlink()  # missing file: COMPLETE alone is not enough
    assert ck.newest_intact(paths) == 4
    (paths.trainer_ckpt_dir(4) / "state.bin").write_bytes(b"x")  # truncated
    ck.begin_part(paths, 8, "trainer")  # being written
    with caplog.at_level(logging.WARNING, logger="hpcrl.checkpoint"):
        assert ck.newest_intact(paths, {}) == 2
        assert ck.resumable(paths) == [2, 4, 6, 8]  # 2, and everything newer a resume could still pick
    warnings = [r.getMessage() for r in caplog.records]
    assert any("step_4" in w and "size" in w for w in warnings)
    assert any("step_6" in w and "missing file" in w for w in warnings)
    assert all("\n" not in w for w in warnings)
    # The caller's memo: a step found intact is trusted until its COMPLETE changes (a stat per call);
    # a broken one is re-checked (and warned about) only when its COMPLETE is rewritten.
    caplog.clear()
    seen = {}
    with caplog.at_level(logging.WARNING, logger="hpcrl.checkpoint"):
        assert ck.newest_intact(paths, seen) == 2
        assert ck.newest_intact(paths, seen) == 2
    assert len(caplog.records) == 2  # step_6 and step_4, once each
    _save(paths, 6)  # rewritten and whole again
    assert ck.newest_intact(paths, seen) == 6
    shutil.rmtree(paths.checkpoints_dir)
    paths.checkpoints_dir.mkdir()
    assert ck.newest_intact(paths, seen) is None and ck.resumable(paths) == []


def test_retention_never_deletes_the_checkpoint_a_resume_would_pick(paths: RunPaths) -> None:
    """keep_last = 1 and the newest COMPLETE's files are gone: the newest intact one stays (resume's
    deep check skips the broken one and falls back to it)."""
    for s in (2, 4, 6):
        _save(paths, s)
    (paths.trainer_ckpt_dir(6) / "state.bin").unlink()
    assert ck.apply_retention(paths, keep_last=1, keep_interval=None) == [2]
    assert ck.list_steps(paths) == [4, 6] and ck.resolve_resume_step(paths, -1) == 4


def test_clear_after_takes_away_every_newer_step_dir(paths: RunPaths) -> None:
    """A killed launch leaves step 3 half written (the orchestrator, a step ahead, already DONE) and
    an explicit older resume finds step 4 complete: after clear_after(2) the resumed trainer's part of
    step 3 can never be finalized with the dead launch's orchestrator part (a mixed COMPLETE)."""
    for s in (1, 2, 4):
        _save(paths, s)
    d = ck.begin_part(paths, 3, "orchestrator")
    (d / "state.bin").write_bytes(b"old launch")
    ck.mark_part_done(paths, 3, "orchestrator")
    deleted, moved = ck.clear_after(paths, 2, "resume_2_1")
    assert (deleted, moved) == ([3], [4])
    assert ck.list_steps(paths) == [1, 2] and ck.latest_complete(paths) == 2
    kept = paths.checkpoints_moved_aside_dir("resume_2_1") / "step_4"
    assert (kept / "COMPLETE").is_file() and (
        kept / "trainer" / "state.bin"
    ).read_bytes() == b"weightstrainer"
    # The resumed launch writes its trainer part of step 3: alone it is not a checkpoint.
    d = ck.begin_part(paths, 3, "trainer")
    ck.mark_part_done(paths, 3, "trainer")
    assert ck.finalize_when_ready(paths, 3, ck.PARTS, trainer_ranks=None, timeout=0.3) is None  # type: ignore[arg-type]
    assert ck.clear_after(paths, 5, "x") == ([], [])  # nothing newer: nothing touched
    assert ck.list_steps(paths) == [1, 2, 3]
