"""What `hpcrl run` checks and says beyond the config itself (seed 001's launch lines).

- `--ckpt.resume-step N --dry-run` verifies the checkpoint it would start from, as
  `hpcrl resume --dry-run` does (a dry run that says OK must not fail at start);
- a `[slurm]` section is for `hpcrl submit`: `hpcrl run` runs on this machine and says so in one line
  (prime-rl's `rl` submits when [slurm] is set; hpcrl keeps the two commands apart).
"""

from __future__ import annotations

from typing import Any

from hpcrl import checkpoint
from hpcrl.paths import RunPaths

SLURM_NOTE = "[slurm] is set, but `hpcrl run` runs on this machine; `hpcrl submit` submits it to SLURM"


def resume_line(cfg: Any) -> str | None:
    """The checkpoint `ckpt.resume_step` names, verified (CheckpointError, one line, when unusable)."""
    if cfg.ckpt is None or cfg.ckpt.resume_step is None:
        return None
    step = checkpoint.resolve_resume_step(RunPaths(cfg.output_dir), cfg.ckpt.resume_step)
    return f"resume:       from checkpoint step_{step} (verified), steps {step + 1}..{cfg.max_steps}"


def run_notes(cfg: Any) -> list[str]:
    return [SLURM_NOTE] if getattr(cfg, "slurm", None) is not None else []
