"""What every config section is built from: the field description shorthand and the base Struct."""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Meta


def D(desc: str, **constraints: Any) -> Meta:
    """Shorthand for a field's description (+ optional range constraints)."""
    return Meta(description=desc, **constraints)


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=False):
    """Base of every config section: unknown keys are errors."""
