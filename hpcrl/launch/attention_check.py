"""The attention kernel against the nodes at dry run (`hpcrl submit --dry-run`): flash-attention 3
needs Hopper or newer GPUs, read from the partition's GRES types."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpcrl.errors import ConfigError

if TYPE_CHECKING:
    from hpcrl.config.schema import Config
    from hpcrl.launch.placement import Placement


# GPU generations flash-attention 3 runs on (Hopper and later), as SLURM GRES types name them.
FA3_GPUS = ("h100", "h200", "h800", "h20", "gh200", "b200", "b300", "gb200", "gb300")


def attention_lines(cfg: Config, placement: Placement, gpu_types: set[str]) -> list[str]:
    """`trainer.model.attn = "flash_attention_3"` against the nodes, at dry run: refused (one line)
    when the partition's GRES types name only GPUs FA3 cannot run on; a note when the GPU type is
    unknown or this Python lacks the kernel (the trainer then stops at start unless the nodes have it)."""
    import importlib.util

    model = cfg.trainer.model or cfg.model
    if model.attn != "flash_attention_3":
        return []
    if not placement.uses_gpus or placement.cpu_compute:
        return [
            "  note:       trainer.model.attn = flash_attention_3 runs as SDPA where roles compute on CPU"
        ]
    if gpu_types and not any(t.startswith(FA3_GPUS) for t in gpu_types):
        raise ConfigError(
            "trainer.model.attn",
            f"flash_attention_3 needs Hopper or newer GPUs; the partition's nodes have {', '.join(sorted(gpu_types))} "
            "(use flash_attention_2 with impl = 'hf', or sdpa)",
        )
    lines = []
    if not gpu_types:
        lines.append(
            "  note:       flash_attention_3 needs Hopper or newer GPUs; sinfo names no GPU type to check"
        )
    if importlib.util.find_spec("flash_attn_interface") is None:
        lines.append(
            "  note:       flash_attention_3: this Python has no flash_attn_interface (flash-attention 3); the "
            "trainer nodes must have it, or the trainer stops at start naming trainer.model.attn"
        )
    return lines
