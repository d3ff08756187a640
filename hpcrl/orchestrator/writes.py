"""Bus writes the filesystem refuses for a while (disk full, a directory made unwritable): named at
once, retried, and given up on in one line only when the trainer would have given up waiting anyway.

A rollout batch is what the trainer waits for: losing it is not an option, and a full disk or a
read-only directory is often fixed by someone within minutes. So a refused write (fileio.REFUSED:
ENOSPC, EDQUOT, EFBIG, EACCES, EPERM, EROFS) is one WARNING naming the path and the cause, retried
every RETRY_EVERY_S without blocking the event loop (requests in flight keep being answered), one
line when it goes through, and WriteRefused (one line: what, path, cause, for how long) past
`give_up_s` (trainer.batch_timeout_s: the trainer stops waiting for the batch then). Publishing the
same batches again completes a step whose files were partly written (Bus.publish_batches).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

from hpcrl.fileio import Refusals, WriteRefused
from hpcrl.monitor import progress

log = logging.getLogger("hpcrl.orchestrator")

RETRY_EVERY_S = 1.0
T = TypeVar("T")

__all__ = ["RETRY_EVERY_S", "WriteRefused", "write_retrying"]


async def write_retrying(
    what: str, write: Callable[[], T], give_up_s: float, every_s: float = RETRY_EVERY_S
) -> T:
    """`write()` until it goes through; a refused write is named, retried, and raised past give_up_s."""
    r = Refusals(what, give_up_s)
    while True:
        try:
            out = write()
        except OSError as e:
            if (why := r.refused(e)) is not None:
                log.warning(
                    "orchestrator: cannot write %s: %s; retrying every %.0f s for up to %.0f s "
                    "(trainer.batch_timeout_s)",
                    what,
                    why,
                    every_s,
                    give_up_s,
                )
                progress.waiting(f"writing {what}: {why}")
            await asyncio.sleep(every_s)
            continue
        if r.named is not None:
            log.warning("orchestrator: wrote %s after %.0f s (it was: %s)", what, r.waited(), r.named)
            progress.done()
        return out
