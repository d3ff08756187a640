"""The one error boundary: every mistake a user can fix is a UserError.

A UserError (a config value, a flag, a file the user named, a checkpoint that does not fit the run) is
raised where the mistake is found, names what is wrong and what is allowed, and is caught once, at
the command line (`hpcrl.cli.main`, and the `python -m` entry points through `user_errors`): one line
on stderr, exit code 2, no traceback. Nothing else catches broad ValueError/FileNotFoundError to
turn it into a message, so anything that is not a UserError is a bug and keeps its traceback.
"""

from __future__ import annotations

import difflib
import json
import re
import sys
from collections.abc import Callable, Iterable


class UserError(Exception):
    """A mistake the user can fix: printed as one line (`<prefix>: <message>`), exit code 2."""

    prefix = "hpcrl: error"

    def one_line(self) -> str:
        return f"{self.prefix}: " + " ".join(str(self).split())


def user_errors(fn: Callable[[], int | None]) -> int:
    """Run an entry point: its UserError becomes one line on stderr and exit code 2."""
    try:
        return int(fn() or 0)
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return 2


# A message is one readable line: whatever value it quotes (a 20 kB string, a 200-deep key path, a
# newline or NUL from a TOML string or the command line) is escaped and shortened here, once.
MAX_PATH = 200
MAX_MESSAGE = 800
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def one_line(text: str, limit: int) -> str:
    """`text` with non-printable characters escaped (\\n, \\x00, \\udcff) and its middle elided
    past `limit` characters (the start names the thing, the end usually says what is allowed)."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    if len(text) > limit:
        head = limit * 2 // 3
        text = f"{text[:head]} … {text[-(limit - head - 3) :]}"
    return text


def show_key(key: str) -> str:
    """A key as TOML writes it in a dotted path: bare when it can be, else quoted (`""`, `"a.b"`)."""
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)


class ConfigError(UserError, ValueError):
    """A user error in a config: printed as one line (`config error: <path>: <what>`), exit code 2.

    Also a ValueError: validation code and tests that expect ValueError for a bad value still do."""

    prefix = "config error"

    def __init__(self, path: str, message: str):
        self.path = one_line(path, MAX_PATH)
        self.message = one_line(message, MAX_MESSAGE)
        super().__init__(f"{self.path}: {self.message}" if self.path else self.message)


def nearest(name: str, candidates: Iterable[str]) -> str:
    """` (did you mean 'x'?)` for the closest candidate, or ''."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""
