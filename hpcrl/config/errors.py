"""The exception type for user mistakes in configs and flags (a UserError, hpcrl/errors.py)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from hpcrl.errors import UserError


class ConfigError(UserError, ValueError):
    """A user error in a config: printed as one line (`config error: <path>: <what>`), exit code 2.

    Also a ValueError: validation code and tests that expect ValueError for a bad value still do."""

    prefix = "config error"

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


def nearest(name: str, candidates: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the closest candidate, or ''."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""
