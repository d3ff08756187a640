"""Keeping the inference servers on a verified policy.

Every load is checked: each server reports the checksum of what it loaded and it must equal the
PolicyReady checksum the trainer computed over the same tensors, else PolicyMismatch ends the run
(a silently stale or corrupt policy would poison every later step). Policy 0 is special only in
that a server already holding those exact weights (GET /weights) is not reloaded.

Filesystem transport: servers load PolicyReady.path. Collective transport: the trainer broadcasts
right after publishing PolicyReady and every server must receive each broadcast, in order, so
policies are loaded one by one, never skipped (servers joined the group at startup: `join_group`).

Dead servers (hpcrl.orchestrator.servers): policies are loaded into the live servers only; `revive`
loads the current policy into a restarted server and verifies it before it takes requests again.
A torch.distributed group cannot take in a new member, so with the collective transport the first
dead server switches the run to the filesystem transport for good (`fall_back_to_files`): the
trainer sees RunPaths.weights_fallback_file before its next publish and writes files from then on;
a restarted server is brought back with the first policy that has a path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from hpcrl.bus import Bus, BusTimeout, PolicyReady, ServerInfo, ShutdownRequested, read_message
from hpcrl.bus.messages import ADAPTER_NAME
from hpcrl.monitor import progress, watchdog
from hpcrl.orchestrator.servers import ServerSet, is_dead
from hpcrl.paths import RunPaths

log = logging.getLogger("hpcrl.orchestrator")
REPUBLISH_S = 60.0  # a failed broadcast is re-published as files within a second or two
BACK_HEALTH_S = 30.0  # a restarted server announces itself once it listens: /health answers at once


LOAD_TRIES = 3  # a policy load that fails on the connection, without a session (servers): tries


class PolicyMismatch(RuntimeError):
    """A server does not hold the weights the trainer published."""


def _reason(e: BaseException) -> str:
    """`Type: message`, never empty: httpx.ReadError() has no message, its type says what happened."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text}" if text else f"{type(e).__name__} (no message)"


class PolicySync:
    def __init__(
        self,
        paths: RunPaths,
        bus: Bus,
        base_urls: list[str],
        transport: str,
        timeout: float,
        policy_timeout: float,
        api_key: str | None = None,
        servers: ServerSet | None = None,
    ):
        from hpcrl.inference.guard import env_api_key

        self.paths, self.bus, self.transport = paths, bus, transport
        self.api_key = env_api_key() if api_key is None else api_key
        self.clients = [self._client(u, timeout) for u in base_urls]
        self.servers = servers
        if servers is not None:
            servers.on_address.append(self.readdress)
        self.timeout, self.policy_timeout = timeout, policy_timeout
        self.loaded: int | None = None  # policy step every server holds (verified)
        # LoRA RL: the name the loaded policy is served under (its adapter), None for full weights.
        # Requests must name it: vLLM applies an adapter only to requests whose `model` is its name.
        self.adapter: str | None = None
        self.newest_seen = -1  # newest PolicyReady observed (for checkpoint triggers)
        self.load_time = 0.0
        self.loading: dict[int, tuple[int, float]] = {}  # position -> (policy step, since): stall reports
        self._lock = asyncio.Lock()
        self._bell: asyncio.Event | None = None
        self._bell_fd: int | None = None

    def _client(self, url: str, timeout: float):
        from hpcrl.inference.client import InferenceClient

        return InferenceClient(url, timeout=timeout, api_key=self.api_key)

    def readdress(self, pos: int, url: str) -> None:
        self.clients[pos] = self._client(url, self.timeout)  # the old one is closed by revive

    def live(self) -> list[int]:
        return self.servers.live() if self.servers is not None else list(range(len(self.clients)))

    async def aclose(self) -> None:
        if self._bell_fd is not None:
            asyncio.get_running_loop().remove_reader(self._bell_fd)
            self._bell_fd = None
        for c in self.clients:
            await c.aclose()

    async def nap(self, seconds: float) -> None:
        """Sleep until the bus doorbell rings (the trainer published a policy) or ``seconds`` pass:
        a new policy is seen within a millisecond instead of on the next poll. The poll stays as
        the fallback (no doorbell, lost rings)."""
        if self._bell is None:
            self._bell = asyncio.Event()
            fd = self.bus.ring_fd()
            if fd is not None:
                asyncio.get_running_loop().add_reader(fd, self._on_ring)
                self._bell_fd = fd
        if self.bus.rings_pending():  # no await since the caller's rescan: nothing can be lost
            return
        self._bell.clear()
        try:
            await asyncio.wait_for(self._bell.wait(), seconds)
        except TimeoutError:
            pass

    def _on_ring(self) -> None:
        # Receiving the rings also re-arms zmq's edge-style fd; without it the loop would spin.
        if self.bus.rings_pending() and self._bell is not None:
            self._bell.set()

    # -- startup --------------------------------------------------------------------------------
    async def wait_healthy(self) -> None:
        await asyncio.gather(*(c.wait_healthy(timeout=self.timeout) for c in self.clients))

    async def join_group(self, servers: Sequence[ServerInfo]) -> None:
        """Collective transport: every server joins trainer rank 0's weight group at its rank offset
        (rendezvous.group_layout), once the group is known to be sized for exactly these servers.
        `servers[i]` is the announcement of the server `self.clients[i]` talks to."""
        from hpcrl.weights.rendezvous import (
            WeightGroupMismatch,
            by_index,
            check_layout,
            read_weight_group_address,
        )

        if len(servers) != len(self.clients):
            raise PolicyMismatch(
                f"join_group got {len(servers)} server announcement(s) for {len(self.clients)} servers"
            )
        addr = await asyncio.to_thread(read_weight_group_address, self.paths, self.policy_timeout)
        try:
            layout = check_layout(addr, servers)
        except WeightGroupMismatch as e:
            raise PolicyMismatch(str(e)) from None
        slot = {
            s.index: (offset, n)
            for s, offset, n in zip(by_index(servers), layout.rank_offsets, layout.receivers)
        }
        await asyncio.gather(
            *(
                c.init_broadcaster(
                    addr.host,
                    addr.port,
                    addr.world_size,
                    slot[s.index][0],
                    receivers=slot[s.index][1],
                    timeout=self.timeout,
                    # The group forms only once every server and the trainer joined: on a big job
                    # that can outlast a server's short control default, so the run's own bound
                    # (trainer.broadcast.timeout_s) is asked for explicitly.
                    join_timeout=self.timeout,
                )
                for c, s in zip(self.clients, servers)
            )
        )
        log.info(
            "%d server(s) joined the weight broadcast group at %s:%s (world_size %d, receivers %s)",
            len(self.clients),
            addr.host,
            addr.port,
            addr.world_size,
            list(layout.receivers),
        )

    # -- waiting for policies ---------------------------------------------------------------------
    async def wait_at_least(self, step: int, poll: float = 0.1) -> PolicyReady:
        """The newest PolicyReady with step >= `step` (bounded by policy_timeout_s). Polls without
        blocking the event loop, so the stop signal and the watcher keep working meanwhile."""
        deadline = time.monotonic() + self.policy_timeout
        while True:
            msg = self.bus.latest_policy()
            if msg is not None:
                self.newest_seen = max(self.newest_seen, msg.step)
                if msg.step >= step:
                    progress.done()
                    return msg
            progress.waiting(f"policy {step} from the trainer ({self.paths.policy_file(step)})", "trainer")
            if (stop := self.bus.poll_control()) is not None:
                raise ShutdownRequested(stop)
            watchdog.beat(f"waiting for policy {step}")  # the trainer's own watchdog covers its stalls
            if time.monotonic() > deadline:
                have = f"newest is {msg.step}" if msg is not None else "none published"
                raise BusTimeout(
                    f"no policy >= {step} after {self.policy_timeout:.0f}s ({have}) in "
                    f"{self.paths.policy_dir}: is the trainer running?"
                )
            await self.nap(poll)

    async def exact(self, step: int) -> PolicyReady:
        """PolicyReady(step) itself, once it (or a newer one) is published."""
        await self.wait_at_least(step)
        try:
            msg = read_message(self.paths.policy_file(step), PolicyReady)
        except FileNotFoundError:
            raise PolicyMismatch(
                f"policy {step} is needed (deterministic mode) but its announcement "
                f"{self.paths.policy_file(step)} is gone: retention keeps old policies only for the "
                "newest intact checkpoint"
            ) from None
        assert msg.step == step, (msg.step, step)
        return msg

    def observe(self) -> int:
        latest = self.bus.latest_policy()
        if latest is not None:
            self.newest_seen = max(self.newest_seen, latest.step)
        return self.newest_seen

    # -- loading ------------------------------------------------------------------------------------
    async def ensure(self, msg: PolicyReady) -> None:
        """Make every server hold policy `msg.step` (collective: every policy up to it, in order)."""
        async with self._lock:
            if self.loaded == msg.step:
                return
            if self.loaded is not None and self.loaded > msg.step and self.transport == "collective":
                raise PolicyMismatch(f"servers hold policy {self.loaded}; a broadcast of {msg.step} is gone")
            if self.transport == "collective" and self.loaded is not None:
                for s in range(self.loaded + 1, msg.step):
                    await self._load(read_message(self.paths.policy_file(s), PolicyReady))
            for m in self._delta_chain(msg):
                await self._load(m)

    def _delta_chain(self, msg: PolicyReady) -> list[PolicyReady]:
        """Policies to load, oldest first, so that `msg` lands: a filesystem delta applies to its base,
        so walk back until the policy the servers hold or a full broadcast (the trainer keeps those
        files). A collective delta always follows its base (every broadcast is received in order)."""
        chain = [msg]
        while (
            self.transport != "collective"
            and chain[-1].base_step is not None
            and chain[-1].base_step != self.loaded
        ):
            chain.append(read_message(self.paths.policy_file(chain[-1].base_step), PolicyReady))
        return chain[::-1]

    async def _load(self, msg: PolicyReady) -> None:
        t0 = time.perf_counter()
        errors = [
            e
            for e in await asyncio.gather(
                *(self._load_or_lose(i, msg) for i in self.live()), return_exceptions=True
            )
            if e is not None
        ]
        if errors and msg.transport == "collective":
            # A receiver died mid-broadcast: the trainer re-publishes this policy as files.
            msg = await self._republished(msg, errors[0])
            self.fall_back_to_files()
            errors = [
                e
                for e in await asyncio.gather(
                    *(self._load_or_lose(i, msg) for i in self.live()), return_exceptions=True
                )
                if e is not None
            ]
        if errors:
            raise errors[0]
        self.loaded = msg.step
        watchdog.beat(f"loaded policy {msg.step}")
        progress.moved(f"loaded policy {msg.step}")
        self.adapter = ADAPTER_NAME if msg.adapter else None  # only once every server holds it
        self.load_time += time.perf_counter() - t0
        log.info(
            "policy %d loaded on %d server(s) (checksum verified, %.2fs)",
            msg.step,
            len(self.live()),
            time.perf_counter() - t0,
        )

    async def _republished(self, msg: PolicyReady, error: BaseException, poll: float = 0.2) -> PolicyReady:
        """Policy `msg.step` as the trainer re-published it with a path after its broadcast failed
        (hpcrl.trainer.publish); `error` when that does not happen within REPUBLISH_S."""
        deadline = time.monotonic() + min(REPUBLISH_S, self.policy_timeout)
        while time.monotonic() < deadline:
            again = read_message(self.paths.policy_file(msg.step), PolicyReady)
            if again.path is not None:
                if again.checksum != msg.checksum:
                    raise PolicyMismatch(
                        f"policy {msg.step} re-published with checksum {again.checksum}, "
                        f"broadcast as {msg.checksum}"
                    )
                log.warning("policy %d: the broadcast failed, loading it from %s", msg.step, again.path)
                return again
            await asyncio.sleep(poll)
        raise error

    async def _load_or_lose(self, pos: int, msg: PolicyReady) -> None:
        """Load into server `pos`; a server that died meanwhile is marked down instead of failing the run
        (its policy is loaded when it comes back)."""

        client = self.clients[pos]
        self.loading[pos] = (msg.step, time.monotonic())
        try:
            await self._load_with_retries(pos, client, msg)
        finally:
            self.loading.pop(pos, None)

    async def _load_with_retries(self, pos: int, client, msg: PolicyReady) -> None:
        import httpx

        for attempt in range(LOAD_TRIES):
            try:
                await self._load_one(client, msg)
                return
            except (httpx.TransportError, PolicyMismatch) as e:
                if isinstance(e, PolicyMismatch) and (self.servers is None or not await is_dead(client)):
                    raise  # it answers and holds other weights: that is a real mismatch
                why = f"policy {msg.step} load failed: {_reason(e)}"
                if self.servers is None:
                    if attempt + 1 < LOAD_TRIES:
                        await asyncio.sleep(1.0 * 2**attempt)
                        continue
                    raise PolicyMismatch(
                        f"server {client.base_url} failed to load policy {msg.step}: {why}"
                    ) from None
                # Dead, frozen, or slow once: never the end of the run. It is marked down; `revive`
                # loads and verifies the current policy once it (or its restarted process) answers.
                log.warning(
                    "%s: %s; it takes no requests until it holds the policy", self.servers.name(pos), why
                )
                self.servers.mark_down(pos, why)
                self.fall_back_to_files()
                return

    async def _load_one(self, client, msg: PolicyReady) -> None:
        from hpcrl.inference.client import WeightSyncError

        if msg.adapter and msg.transport == "filesystem":  # LoRA RL: the server merges the adapter
            try:
                r = await client.load_lora_adapter(ADAPTER_NAME, str(msg.path), step=msg.step)
            except WeightSyncError as e:
                raise PolicyMismatch(
                    f"server {client.base_url} failed to load the adapter of policy {msg.step}: {_reason(e)}"
                ) from None
            if r.get("checksum") != msg.checksum:
                raise PolicyMismatch(
                    f"server {client.base_url} loaded adapter checksum {r.get('checksum')} for policy "
                    f"{msg.step}, the trainer published {msg.checksum}"
                )
            return
        if msg.transport == "filesystem" and self.loaded is None:
            info = await client.weights()
            # Same bytes already loaded (policy 0 on fresh servers): reloading would only cost time.
            # Asked only before the first load: afterwards every new policy is new bytes, and the
            # round trip would sit on the critical path of every step.
            if info.get("checksum") == msg.checksum and info.get("step") == msg.step:
                return
        try:
            if msg.transport == "collective":  # full weights, a delta or (LoRA) the adapter: the header says
                r = await client.update_weights(msg.step, collective=True, expected_checksum=msg.checksum)
            else:
                r = await client.update_weights(msg.step, path=msg.path, expected_checksum=msg.checksum)
        except WeightSyncError as e:
            raise PolicyMismatch(
                f"server {client.base_url} failed to load policy {msg.step}: {_reason(e)}"
            ) from None
        if r.get("checksum") != msg.checksum:
            raise PolicyMismatch(
                f"server {client.base_url} holds checksum {r.get('checksum')} after loading "
                f"policy {msg.step}, the trainer published {msg.checksum}"
            )

    async def verify(self, msg: PolicyReady) -> None:
        """Every server reports exactly `msg`'s checksum (GET /weights)."""
        clients = [self.clients[i] for i in self.live()]
        infos = await asyncio.gather(*(c.weights() for c in clients))
        for c, info in zip(clients, infos):
            if msg.adapter:  # the base's checksum is unchanged; the merged adapter must be this policy's
                if (
                    info.get("step") != msg.step
                    or info.get("lora_checksum") != msg.checksum
                    or ADAPTER_NAME not in (info.get("lora_adapters") or {})
                ):
                    raise PolicyMismatch(
                        f"server {c.base_url} holds step {info.get('step')} / adapters "
                        f"{info.get('lora_adapters')} ({info.get('lora_checksum')}), policy "
                        f"{msg.step} is adapter {ADAPTER_NAME!r} ({msg.checksum})"
                    )
                continue
            if info.get("checksum") != msg.checksum:
                raise PolicyMismatch(
                    f"server {c.base_url} holds checksum {info.get('checksum')} (step "
                    f"{info.get('step')}), policy {msg.step} has {msg.checksum}"
                )

    # -- in-flight updates (non-deterministic mode) -------------------------------------------------
    async def watch(self, poll: float = 0.2) -> None:
        """Load every newer policy as soon as it is published, while generation goes on. Runs until
        cancelled; a failed load propagates (the main loop checks the task)."""
        while True:
            latest = self.bus.latest_policy()
            if latest is not None and (self.loaded is None or latest.step > self.loaded):
                self.newest_seen = max(self.newest_seen, latest.step)
                await self.ensure(latest)
            await self.nap(poll)

    # -- dead servers -------------------------------------------------------------------------------
    def fall_back_to_files(self) -> None:
        """Collective transport and a server is gone: the weight group cannot take its restarted
        process in (nor broadcast past the dead member), so ask the trainer for files from now on."""
        if self.transport != "collective":
            return
        from hpcrl.bus.files import write_atomic

        write_atomic(self.paths.weights_fallback_file, [b"a server died: the weight group is broken\n"])
        self.transport = "filesystem"
        log.warning(
            "collective weight transport: a server died, so policies travel as files from the next "
            "one on (a torch.distributed group cannot take in a restarted server)"
        )

    async def revive(self, poll: float = 1.0) -> None:
        """Runs until cancelled: a down server that was restarted (a new announcement) gets the current
        policy, verified, and then takes requests again. Raises InferenceUnavailable (naming the server)
        when one stays down past its deadline."""
        assert self.servers is not None
        while True:
            self.servers.check_deadline()
            for pos in list(self.servers.down):
                info = self.servers.restarted(pos)
                same = info is None and self.servers.announced(pos) == self.servers.infos[pos]
                if same and not await is_dead(self.clients[pos]):
                    info = self.servers.infos[pos]  # the same process answers again (it was frozen)
                if info is not None:
                    await self._bring_back(pos, info)
            await asyncio.sleep(poll)

    async def _bring_back(self, pos: int, info: ServerInfo) -> None:
        from hpcrl.inference.client import InferenceError

        assert self.servers is not None
        client = self._client(info.base_url, self.timeout)
        try:
            await client.wait_healthy(timeout=BACK_HEALTH_S)  # outside the lock: loads go on meanwhile
            async with self._lock:  # no other policy load races with this one
                msg = self._current()
                if msg is None:
                    return  # a collective policy has no path: wait for the trainer's first file policy
                await self._load_one(client, msg)  # compares the checksum the server reports
                if not msg.adapter and (got := (await client.weights()).get("checksum")) != msg.checksum:
                    raise PolicyMismatch(f"holds checksum {got}, policy {msg.step} has {msg.checksum}")
                old = self.clients[pos]
                self.servers.returned(pos, info)  # readdress() swaps in a client for the new url
                if self.clients[pos] is not old:
                    await old.aclose()
        except (TimeoutError, PolicyMismatch, InferenceError, OSError) as e:
            log.warning("restarted %s is not usable yet: %s", self.servers.name(pos), e)
        finally:
            await client.aclose()

    def _current(self) -> PolicyReady | None:
        """The policy every live server holds, if a restarted server can load it from a path."""
        if self.loaded is None:
            return None
        msg = read_message(self.paths.policy_file(self.loaded), PolicyReady)
        return msg if msg.path is not None else None
