"""Which inference servers are up, and where each one listens now.

A server that stops answering (connection refused or reset, and /health does not answer either) is
marked down: ServerPool sends its requests (and retries in-flight ones) to the other servers, and
PolicySync stops loading policies into it. Its supervisor (hpcrl run, or the SLURM server step:
hpcrl.launch.keepalive) restarts it; the restarted process rewrites bus/servers/server_<index>.json
with its new pid and port. `PolicySync.revive` notices that, loads the current policy into it,
compares the checksum, and only then marks it up again (`returned`), so no request ever reaches a
server holding other weights. A server down for longer than `down_timeout_s` ends the run with a
message naming it (InferenceUnavailable).

Positions (0..K-1) index the servers the orchestrator talks to; `ServerInfo.index` names the file.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from hpcrl.bus import ServerInfo
from hpcrl.bus.errors import CorruptMessageError
from hpcrl.bus.files import decode_json_file
from hpcrl.paths import RunPaths

log = logging.getLogger("hpcrl.orchestrator")

PROBE_TIMEOUT_S = 2.0  # /health of a suspect server: a live one answers at once (it runs off the event loop)


class InferenceUnavailable(RuntimeError):
    """The servers stopped answering altogether: the run fails with this message."""


class ServerSet:
    def __init__(self, paths: RunPaths, infos: Sequence[ServerInfo], down_timeout_s: float):
        self.paths = paths
        self.infos = list(infos)
        self.down_timeout_s = down_timeout_s
        self.down: dict[int, float] = {}  # position -> time.monotonic() it was marked down
        # Alive (same process) but not answering /health: no new requests while others answer
        # (position -> since when; hpcrl.orchestrator.stalls keeps it).
        self.unresponsive: dict[int, float] = {}
        self.log_lost: dict[int, int] = {}  # position -> log lines its process lost (the /metrics poller)
        self.restarts = 0  # servers that came back as a new process (metric inference/server_restarts)
        self.on_address: list[Callable[[int, str], None]] = []  # (position, new base_url) subscribers
        self._up_event: asyncio.Event | None = None

    def __len__(self) -> int:
        return len(self.infos)

    def name(self, pos: int) -> str:
        return f"inference server {self.infos[pos].index} ({self.infos[pos].base_url})"

    def is_up(self, pos: int) -> bool:
        return pos not in self.down

    def live(self) -> list[int]:
        return [i for i in range(len(self.infos)) if i not in self.down]

    def mark_down(self, pos: int, why: str) -> None:
        if pos in self.down:
            return
        self.down[pos] = time.monotonic()
        log.warning(
            "%s is down (%s): its requests go to the other servers; waiting up to %.0fs for it to come back",
            self.name(pos),
            why,
            self.down_timeout_s,
        )

    def check_deadline(self) -> None:
        """InferenceUnavailable naming the first server down longer than down_timeout_s."""
        now = time.monotonic()
        for pos, since in sorted(self.down.items(), key=lambda kv: kv[1]):
            if now - since > self.down_timeout_s:
                raise InferenceUnavailable(
                    f"{self.name(pos)} died and did not come back within "
                    f"{self.down_timeout_s:.0f}s (orchestrator.server_down_timeout_s)"
                )

    def announced(self, pos: int) -> ServerInfo | None:
        """What the server's file says now (None while there is no readable file)."""
        try:
            return decode_json_file(self.paths.server_file(self.infos[pos].index), ServerInfo)
        except (FileNotFoundError, CorruptMessageError):
            return None

    def restarted(self, pos: int) -> ServerInfo | None:
        """The announcement of a new process for a down server, once one exists."""
        info = self.announced(pos)
        old = self.infos[pos]
        if info is None or (info.pid, info.created_at, info.base_url) == (
            old.pid,
            old.created_at,
            old.base_url,
        ):
            return None
        return info

    def returned(self, pos: int, info: ServerInfo) -> None:
        """The server at `pos` is up again as `info` (its policy already loaded and verified)."""
        old = self.infos[pos]
        self.infos[pos] = info
        if info.base_url != old.base_url:
            for notify in self.on_address:
                notify(pos, info.base_url)
        self.down.pop(pos, None)
        self.unresponsive.pop(pos, None)
        if info.pid == old.pid and info.created_at == old.created_at:  # the same process answers again
            log.warning(
                "%s answers again (pid %d, same process): policy loaded and verified; it rejoins",
                self.name(pos),
                info.pid,
            )
        else:
            self.restarts += 1
            self.log_lost.pop(pos, None)  # the dead process's count: the new one counts its own
            log.warning(
                "%s is back (pid %d, was %d): policy loaded and verified; sending it requests again",
                self.name(pos),
                info.pid,
                old.pid,
            )
        if self._up_event is not None:
            self._up_event.set()

    async def wait_live(self, poll: float = 1.0) -> None:
        """Until some server is up; InferenceUnavailable once one has been down too long."""
        while not self.live():
            self.check_deadline()
            if self._up_event is None:
                self._up_event = asyncio.Event()
            self._up_event.clear()
            try:
                await asyncio.wait_for(self._up_event.wait(), poll)
            except TimeoutError:
                pass


async def is_dead(client) -> bool:
    """True when `client`'s server does not answer /health within PROBE_TIMEOUT_S."""
    import httpx

    try:
        await asyncio.wait_for(client.health(), PROBE_TIMEOUT_S)
        return False
    except (httpx.HTTPError, TimeoutError, OSError):
        return True
    except Exception:  # noqa: BLE001 - an error answer (e.g. 503 while loading) is still an answer
        return False
