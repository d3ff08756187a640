"""What every config section is built from: the field description shorthand and the base Struct."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Meta

# Upper bounds of hardware sizes: far above any machine, low enough that the memory plan's byte
# arithmetic and per-GPU lists stay finite and small (1e308 GiB overflowed to inf, 2^64 GPUs per
# node filled memory).
MAX_GPUS_PER_NODE = 1024
MAX_GPU_MEMORY_GIB = 2**20  # 1 PiB


def D(desc: str, **constraints: Any) -> Meta:
    """Shorthand for a field's description (+ optional range constraints)."""
    return Meta(description=desc, **constraints)


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=False):
    """Base of every config section: unknown keys are errors."""
