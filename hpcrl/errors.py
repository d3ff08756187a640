"""The one error boundary: every mistake a user can fix is a UserError.

A UserError (a config value, a flag, a file the user named, a checkpoint that does not fit the run) is
raised where the mistake is found, names what is wrong and what is allowed, and is caught once, at
the command line (`hpcrl.cli.main`, and the `python -m` entry points through `user_errors`): one line
on stderr, exit code 2, no traceback. Nothing else catches broad ValueError/FileNotFoundError to
turn it into a message, so anything that is not a UserError is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


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
