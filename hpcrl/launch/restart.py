"""What every (re)start of a run directory does before its roles start, shared by `hpcrl run`,
`hpcrl resume`, `hpcrl submit` and the batch script's `prepare-resume`: validate the checkpoint to
resume from, move bus files and checkpoint directories newer than it aside, forget addresses of
processes that are gone.

The `hpcrl resume` command itself is hpcrl/launch/resume.py; it imports the launchers, which import
this module (never the other way round).
"""

from __future__ import annotations

import time
from pathlib import Path

from hpcrl import checkpoint
from hpcrl.config.schema import Config
from hpcrl.errors import ConfigError
from hpcrl.paths import RunPaths


class AlreadyComplete(Exception):
    """The checkpoint to resume from is the final step: there is nothing left to train."""


def clear_stale_addresses(paths: RunPaths) -> None:
    """Server and weight-group addresses of a previous (dead) launch must not be dialled."""
    for f in list(paths.servers_dir.glob("*.json")) + [
        paths.endpoint_file("weights"),
        paths.weights_fallback_file,
    ]:
        f.unlink(missing_ok=True)


def set_aside_after(paths: RunPaths, step: int) -> list:
    """Move what the interrupted launch wrote after `step` aside: bus files newer than it, the
    announcement of policy `step` (the resumed trainer publishes it again from the checkpoint), and
    checkpoint directories newer than it (checkpoint.clear_after: incomplete ones deleted, complete
    ones kept under checkpoints/moved_aside/). Returns the bus files' new locations."""
    from hpcrl.bus import Bus

    tag = f"resume_{step}_{int(time.time())}"
    bus = Bus(paths, role="launcher", listen=False)
    try:
        moved = bus.move_aside_after(step, tag=tag, republished=True)
    finally:
        bus.close()
    deleted, kept = checkpoint.clear_after(paths, step, tag)
    if deleted or kept:
        print(
            f"hpcrl: checkpoint dir(s) newer than step {step}: "
            + ", ".join(
                [f"step_{s} (incomplete) removed" for s in deleted]
                + [f"step_{s} moved to {paths.checkpoints_moved_aside_dir(tag)}" for s in kept]
            ),
            flush=True,
        )
    return moved


def check_old_policies(cfg: Config, paths: RunPaths, step: int) -> None:
    """A deterministic resume from checkpoint N reloads policies N - max_async_level .. N - 1 (the
    batches after N were made with them). The trainer keeps those only for its newest intact
    checkpoint (trainer/publish.py); resuming an older one cannot be bitwise lossless, so refuse it
    in one line instead of failing later inside the orchestrator."""
    lag = cfg.orchestrator.max_async_level
    if not cfg.deterministic or lag == 0:
        return
    from hpcrl.bus import CorruptMessageError, PolicyReady, read_message

    for s in range(max(0, step - lag), step):
        try:
            msg = read_message(paths.policy_file(s), PolicyReady)
            ok = msg.path is None or Path(msg.path).exists()
        except (OSError, CorruptMessageError):  # missing or unreadable announcement
            ok = False
        if not ok:
            newest = checkpoint.latest_complete(paths)
            raise ConfigError(
                "ckpt.resume_step",
                f"step {step}: the weights of policy {s}, which a deterministic resume reloads "
                f"(max_async_level {lag}), are no longer kept; the newest checkpoint (step {newest}) "
                "can be resumed: --step -1",
            )


def prepare_resume(cfg: Config, paths: RunPaths) -> list[str]:
    """If the config asks to resume, validate the checkpoint, move newer bus files aside and return
    the flags that pin every role to that exact step; else []."""
    if cfg.ckpt is None or cfg.ckpt.resume_step is None:
        if any(paths.bus_dir.glob("*/*")) or checkpoint.list_steps(paths):
            # A fresh run in a used directory (as `hpcrl prepare-resume` starts a fresh SLURM job):
            # the old run's rollouts, policies, stop announcements and checkpoints are not this run's.
            moved = set_aside_after(paths, 0)
            if moved:
                print(
                    f"hpcrl: starting fresh in a used directory: moved {len(moved)} old bus file(s) aside",
                    flush=True,
                )
        return []
    try:
        step = checkpoint.resolve_resume_step(paths, cfg.ckpt.resume_step)
    except checkpoint.CheckpointError as e:
        raise ConfigError("ckpt.resume_step", str(e)) from None
    if step == cfg.max_steps:
        raise AlreadyComplete(
            f"hpcrl: {paths.root} is complete at step {step} (max_steps); pass --max-steps M to train further"
        )
    if step > cfg.max_steps:
        raise ConfigError(
            "max_steps", f"{cfg.max_steps} is below the resumed step {step} (max_steps is the final step)"
        )
    check_old_policies(cfg, paths, step)
    moved = set_aside_after(paths, step)
    # Policy files below N stay (a deterministic orchestrator reloads N - max_async_level ..); the
    # trainer re-publishes N; weights/broadcasts newer than N are stale.
    print(
        f"hpcrl: resuming from {paths.checkpoint_dir(step)} (moved {len(moved)} newer bus file(s) aside)",
        flush=True,
    )
    return ["--ckpt.resume-step", str(step)]
