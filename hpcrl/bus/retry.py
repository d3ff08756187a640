"""A bus write the filesystem refuses for a while (disk full, an unwritable directory), in a blocking
caller: named at once, retried, one line when it goes through, WriteRefused (one line) past its
bound. The trainer's policy announcements go through here (Bus.publish_policy); the orchestrator's
asyncio twin is hpcrl.orchestrator.writes. Both keep their books in fileio.Refusals."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from hpcrl.fileio import Refusals
from hpcrl.monitor import progress

log = logging.getLogger("hpcrl.bus")

RETRY_EVERY_S = 1.0
T = TypeVar("T")


def write_retrying_blocking(
    who: str, what: str, write: Callable[[], T], give_up_s: float, bound: str, every_s: float = RETRY_EVERY_S
) -> T:
    """`write()` until it goes through; `who` prefixes each line, `bound` names the setting that
    gives give_up_s (0: a refusal raises at once)."""
    r = Refusals(what, give_up_s)
    while True:
        try:
            out = write()
        except OSError as e:
            if (why := r.refused(e)) is not None:
                log.warning(
                    "%scannot write %s: %s; retrying every %.0f s for up to %.0f s (%s)",
                    who, what, why, every_s, give_up_s, bound,
                )  # fmt: skip
                progress.waiting(f"writing {what}: {why}")  # the stall line names it too
            time.sleep(every_s)
            continue
        if r.named is not None:
            log.warning("%swrote %s after %.0f s (it was: %s)", who, what, r.waited(), r.named)
            progress.done()
        return out
