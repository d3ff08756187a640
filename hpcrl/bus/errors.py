"""Bus exceptions. Every one names what was expected and where, so a log line is enough to debug."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpcrl.bus.messages import Shutdown


class BusError(Exception):
    """Base class of every bus error."""


class BusTimeout(BusError, TimeoutError):
    """A bounded wait ran out. The message says what was awaited, where, and what was there instead."""


class CorruptMessageError(BusError):
    """A bus file (or buffer) is truncated, bit-flipped, foreign or of an unexpected type.

    `path` is None while decoding an in-memory buffer; the file layer fills it in.
    """

    def __init__(self, reason: str, path: Path | str | None = None, inode: int | None = None):
        self.reason = reason
        self.path = Path(path) if path is not None else None
        self.inode = inode  # of the file that failed, so reject() never moves a newer replacement
        super().__init__(f"{path}: {reason}" if path is not None else reason)

    def with_path(self, path: Path | str, inode: int | None = None) -> CorruptMessageError:
        return CorruptMessageError(self.reason, path, inode)


class ShutdownRequested(BusError):
    """A wait was interrupted because some role published a Shutdown control message."""

    def __init__(self, message: Shutdown):
        self.message = message
        super().__init__(f"shutdown requested by {message.origin}: {message.reason}")
