"""The orchestrator's bus writes under the storage policy (hpcrl.storage): a rollout batch the
filesystem refuses (disk full, a directory made unwritable) is named once, retried with backoff
without blocking the event loop (requests in flight keep being answered), and given up on in one
line past storage_timeout_s. Publishing the same batches again completes a step whose files were
partly written (Bus.publish_batches). The orchestrator's checkpoint part takes the same road
(OrchestratorLoop.save)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from hpcrl.storage import WriteRefused, retry_async

T = TypeVar("T")

__all__ = ["WriteRefused", "write_retrying"]


async def write_retrying(
    what: str, write: Callable[[], T], timeout_s: float, *, path: Path | None = None, **backoff: float
) -> T:
    """`write()` until it goes through; a refused write is named, retried, and raised past timeout_s.
    `path` names the file when the error does not."""
    return await retry_async("orchestrator", what, write, timeout_s, path=path, **backoff)
