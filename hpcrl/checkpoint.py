"""step_N checkpoints: parts, the COMPLETE manifest, finding the newest valid one, retention.

A checkpoint is `checkpoints/step_N/` holding one directory per part (`trainer/`, `orchestrator/`).
Each part writes its files and then a `DONE` marker. When every expected part is done, one process
writes `COMPLETE` last: a manifest listing every file with its size and sha256. Only a step whose
COMPLETE parses and whose files all match counts as a checkpoint, so a crash at any moment while
saving leaves the previous checkpoint the newest valid one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections.abc import Collection
from pathlib import Path

import msgspec

from hpcrl.errors import UserError
from hpcrl.fileio import write_atomic
from hpcrl.paths import RunPaths, parse_step_dir

log = logging.getLogger("hpcrl.checkpoint")

PARTS = ("trainer", "orchestrator")
_DONE = "DONE"


class FileEntry(msgspec.Struct):
    path: str  # relative to step_N/
    size: int
    sha256: str


class Manifest(msgspec.Struct):
    step: int
    created_at: float
    parts: list[str]
    files: list[FileEntry]
    format: int = 1


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used as asked (missing, incomplete, corrupt): one line, exit 2."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """tmp + fsync + rename + dir fsync (the bus's writer): readers see the old file or the new one."""
    write_atomic(path, [data])


def part_dir(paths: RunPaths, step: int, part: str) -> Path:
    assert part in PARTS, part
    return paths.trainer_ckpt_dir(step) if part == "trainer" else paths.orchestrator_ckpt_dir(step)


def begin_part(paths: RunPaths, step: int, part: str, clear: bool = True) -> Path:
    """Create (and by default empty) one part's directory; a stale COMPLETE for this step is removed."""
    complete = paths.complete_file(step)
    if complete.exists():
        complete.unlink()
    d = part_dir(paths, step, part)
    if clear and d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True, exist_ok=True)
    return d


def mark_part_done(paths: RunPaths, step: int, part: str, rank: int | None = None) -> None:
    """Files of this part (or of one rank of it) are durable."""
    d = part_dir(paths, step, part)
    for f in d.rglob("*"):
        if f.is_file() and ".tmp-" not in f.name:
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    name = _DONE if rank is None else f"{_DONE}.rank_{rank}"
    atomic_write_bytes(d / name, str(time.time()).encode())


def part_done(paths: RunPaths, step: int, part: str, ranks: int | None = None) -> bool:
    d = part_dir(paths, step, part)
    if ranks is None:
        return (d / _DONE).exists()
    return all((d / f"{_DONE}.rank_{r}").exists() for r in range(ranks))


def write_complete(paths: RunPaths, step: int, parts: tuple[str, ...] = PARTS) -> Manifest:
    """Hash every file of step_N and write COMPLETE last."""
    root = paths.checkpoint_dir(step)
    entries = []
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.name != "COMPLETE" and ".tmp-" not in f.name:
            entries.append(FileEntry(str(f.relative_to(root)), f.stat().st_size, sha256_file(f)))
    manifest = Manifest(step=step, created_at=time.time(), parts=list(parts), files=entries)
    atomic_write_bytes(paths.complete_file(step), msgspec.json.encode(manifest))
    return manifest


def finalize_when_ready(
    paths: RunPaths, step: int, parts: tuple[str, ...], trainer_ranks: int, timeout: float, poll: float = 0.2
) -> Manifest | None:
    """Wait (bounded) until every part is done, then write COMPLETE. None on timeout (logged)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not paths.checkpoint_dir(step).is_dir():
            log.warning("checkpoint step_%d was removed before it was finalized", step)
            return None
        ready = all(part_done(paths, step, p, trainer_ranks if p == "trainer" else None) for p in parts)
        if ready:
            return write_complete(paths, step, parts)
        time.sleep(poll)
    missing = [p for p in parts if not part_done(paths, step, p, trainer_ranks if p == "trainer" else None)]
    log.error("checkpoint step_%d not finalized: part(s) %s not done after %.0fs", step, missing, timeout)
    return None


def verify(paths: RunPaths, step: int, deep: bool = True) -> str | None:
    """None if step_N is a valid checkpoint, else the reason it is not."""
    complete = paths.complete_file(step)
    if not complete.is_file():
        return "no COMPLETE manifest"
    try:
        manifest = msgspec.json.decode(complete.read_bytes(), type=Manifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        return f"COMPLETE is corrupt ({e})"
    if manifest.step != step:
        return f"COMPLETE names step {manifest.step}"
    root = paths.checkpoint_dir(step)
    for e in manifest.files:
        f = root / e.path
        if not f.is_file():
            return f"missing file {e.path}"
        if f.stat().st_size != e.size:
            return f"size of {e.path} is {f.stat().st_size}, manifest says {e.size}"
        if deep and sha256_file(f) != e.sha256:
            return f"checksum of {e.path} does not match"
    return None


def list_steps(paths: RunPaths) -> list[int]:
    return RunPaths.steps_in(paths.checkpoints_dir)


def latest_complete(paths: RunPaths, at_most: int | None = None) -> int | None:
    """Newest step whose COMPLETE verifies; newer broken ones are skipped with a warning naming them."""
    for step in reversed(list_steps(paths)):
        if at_most is not None and step > at_most:
            continue
        reason = verify(paths, step)
        if reason is None:
            return step
        log.warning("skipping checkpoint %s: %s", paths.checkpoint_dir(step), reason)
    return None


def newest_intact(paths: RunPaths, seen: dict[int, tuple[int, str | None]] | None = None) -> int | None:
    """Newest step whose COMPLETE parses and whose files are all there at their manifest sizes
    (``verify(deep=False)``: stats, no hashing); a newer one that fails is skipped with a one-line
    warning, so what protects a resume protects the checkpoint a resume would really pick.

    ``seen`` (caller-owned, for callers asking every training step) maps a step to its COMPLETE's
    mtime_ns and verdict: a step is re-checked (and warned about) only when its COMPLETE changes, so
    a steady call costs one listing and a stat per step tried. A file that vanishes after its
    step was found intact is caught by resume's deep check (``latest_complete``)."""
    seen = {} if seen is None else seen
    for step in reversed(list_steps(paths)):
        try:
            mtime = paths.complete_file(step).stat().st_mtime_ns
        except FileNotFoundError:
            continue
        known = seen.get(step)
        if known is None or known[0] != mtime:
            reason = verify(paths, step, deep=False)
            if reason is not None:
                log.warning(
                    "checkpoint %s is marked COMPLETE but unusable: %s", paths.checkpoint_dir(step), reason
                )
            seen[step] = known = (mtime, reason)
        if known[1] is None:
            return step
    return None


def resumable(paths: RunPaths, seen: dict[int, tuple[int, str | None]] | None = None) -> list[int]:
    """Steps a resume may start from, now or once the checkpoints being written complete: the newest
    intact one (``newest_intact``) and every newer step directory (being written, or broken). What a
    resume from these needs must be kept (hpcrl.trainer.publish)."""
    newest = newest_intact(paths, seen)
    return [s for s in list_steps(paths) if newest is None or s >= newest]


def resolve_resume_step(paths: RunPaths, requested: int) -> int:
    """-1 -> newest valid; N -> N if valid. Raises CheckpointError naming what is wrong."""
    if requested == -1:
        step = latest_complete(paths)
        if step is None:
            raise CheckpointError(f"no complete checkpoint under {paths.checkpoints_dir}")
        return step
    reason = verify(paths, requested)
    if reason is not None:
        raise CheckpointError(f"checkpoint {paths.checkpoint_dir(requested)} is not usable: {reason}")
    return requested


def clear_after(paths: RunPaths, step: int, tag: str) -> tuple[list[int], list[int]]:
    """Before a launch resumes from `step` (0: a fresh start in a used directory), take away every
    step_M directory with M > step: they are the interrupted launch's. Left in place, a part of one
    (the orchestrator runs a step ahead of the trainer, so step N+1's orchestrator part is often
    DONE) and the resumed launch's other part of the same step would be finalized together: a
    COMPLETE mixing two launches' states, which the next resume would trust (a prompt skipped).
    Incomplete ones are deleted (COMPLETE-less, nothing can resume from them); complete ones (an
    explicit older --step) move to checkpoints/moved_aside/<tag>/, nothing of them lost.
    Returns (deleted, moved) steps."""
    deleted, moved = [], []
    for s in list_steps(paths):
        if s <= step:
            continue
        src = paths.checkpoint_dir(s)
        if paths.complete_file(s).is_file():
            dst = paths.checkpoints_moved_aside_dir(tag) / src.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.replace(src, dst)
            moved.append(s)
        else:
            shutil.rmtree(src, ignore_errors=True)
            deleted.append(s)
    return deleted, moved


def retention_keep(steps: list[int], keep_last: int | None, keep_interval: int | None) -> set[int]:
    """Pure: which complete steps to keep (newest keep_last, plus every keep_interval-th)."""
    if keep_last is None:
        return set(steps)
    keep = set(sorted(steps)[-keep_last:])
    if keep_interval:
        keep |= {s for s in steps if s % keep_interval == 0}
    return keep


def apply_retention(
    paths: RunPaths, keep_last: int | None, keep_interval: int | None, in_progress: Collection[int] = ()
) -> list[int]:
    """Delete complete checkpoints outside the keep set, and incomplete ones older than the newest
    valid — except ``in_progress`` ones (their finalizer is still waiting for a part: with fast steps
    step N+1 can complete before step N, which must not be deleted under its finalizer)."""
    steps = list_steps(paths)
    complete = [s for s in steps if paths.complete_file(s).is_file()]
    keep = retention_keep(complete, keep_last, keep_interval)
    # Never the checkpoint a resume would pick: a newer COMPLETE whose files are gone does not count.
    intact = newest_intact(paths)
    if intact is not None:
        keep.add(intact)
    newest = max(complete) if complete else None
    removed = []
    for s in steps:
        incomplete_old = s not in complete and s not in in_progress and newest is not None and s < newest
        if (s in complete and s not in keep) or incomplete_old:
            # Remove COMPLETE first: a crash mid-delete leaves an (ignored) incomplete dir, never a
            # COMPLETE that points at missing files.
            c = paths.complete_file(s)
            if c.exists():
                c.unlink()
            shutil.rmtree(paths.checkpoint_dir(s), ignore_errors=True)
            removed.append(s)
    return removed


# ckpt.hf_weights = "auto": rank 0 writes the HF weights of every checkpoint alone (a 16 GiB policy is
# ~13 s at the 1.3 GB/s one writer reached here, docs/weights.md; Qwen3-30B-A3B's 61 GB would hold every
# rank ~47 s per checkpoint and add 12 % to its disk): above this size `hpcrl export` writes them on demand.
HF_WEIGHTS_AUTO_MAX_BYTES = 16 * 2**30


def writes_hf_weights(setting: str, weights_only: bool, policy_bytes: int) -> bool:
    """Does a checkpoint write weights/step_N? ckpt.hf_weights: always / never / auto (a policy of at
    most HF_WEIGHTS_AUTO_MAX_BYTES); a weights_only checkpoint is nothing else."""
    if weights_only or setting == "always":
        return True
    return setting == "auto" and policy_bytes <= HF_WEIGHTS_AUTO_MAX_BYTES


def is_due(step: int, max_steps: int, interval: int | None) -> bool:
    """Checkpoint after this step? Every `interval` steps, and always at the final step."""
    return step == max_steps or (interval is not None and step % interval == 0)


__all__ = [
    "CheckpointError",
    "Manifest",
    "apply_retention",
    "atomic_write_bytes",
    "begin_part",
    "finalize_when_ready",
    "is_due",
    "latest_complete",
    "mark_part_done",
    "newest_intact",
    "part_done",
    "parse_step_dir",
    "resolve_resume_step",
    "resumable",
    "retention_keep",
    "verify",
    "write_complete",
    "writes_hf_weights",
]
