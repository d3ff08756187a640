"""The orchestrator's side of an env server: an Environment whose rollouts run in other processes.

`RemoteEnvironment` starts `python -m hpcrl.envs.runtime.server` (one per train/eval env; as its child, or
on an env node through that node's env host: hpcrl.envs.runtime.hosting), learns the env's
tasks, tools and turn limit from its `Hello`, and then sends each rollout as one `Run` message to a
worker (hpcrl.envs.runtime.routing picks it; workers connect to this process's socket directly). While a
rollout runs, its worker asks for model turns (`Chat`); those are answered here with the very
ChatClient the rollout driver handed in (RolloutClient, a shared first turn, a group's client), so
stitching, policy versions and retries are the same as in-process. No env code runs in this process.

A worker that dies (the server says `WorkerDied`) or overruns `rollout_timeout_s` in env code (this
side sees it and sends `Kill`) errors the rollouts it held. If the server process dies, every
rollout is errored and the server is started again (at most `max_restarts` times in a run, then
EnvServerFailed ends the run naming the env).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from hpcrl.envs.base import ChatClient, Environment, Task, Trajectory
from hpcrl.envs.errors import EnvServerFailed
from hpcrl.envs.runtime.hosting import HostedServer, LocalServer
from hpcrl.envs.runtime.routing import Router
from hpcrl.envs.runtime.server import server_ident, server_log
from hpcrl.envs.wire import messages as wire
from hpcrl.envs.wire.frames import Outbox, drain

log = logging.getLogger("hpcrl.orchestrator.remote_env")
HELLO_TIMEOUT_S = 300.0  # loading an env may download/prepare data: generous, but not forever
WATCH_S = 0.2
PING_S = 1.0  # the server is asked `Ping` this often (spec.frozen_s > 0): no Pong for frozen_s = frozen


class EnvRolloutError(RuntimeError):
    """A rollout the env server answered with an error (the env raised, a worker died or hung)."""


class EnvComponentLost(EnvRolloutError):
    """A rollout errored because the worker or env server holding it died or was killed frozen. One
    such event errors every rollout it held at once; its message names the lost process (pid), so
    hpcrl.orchestrator.causes counts each event once towards a systematic failure: a restart that
    errors 64 rollouts in flight does not end the run, a worker dying on every rollout still does."""


class RemoteEnvironment(Environment):
    def __init__(
        self,
        spec: wire.ServerSpec,
        max_restarts: int = 3,
        wait: bool = True,
        server: LocalServer | HostedServer | None = None,
        bind_host: str = "127.0.0.1",
    ):
        """Starts the env server; `wait=False` leaves waiting for its Hello to `wait_ready()`
        (several servers then load their envs at the same time). `server`: who starts it
        (hpcrl.envs.runtime.hosting; default this process's child); `bind_host`: the address its workers
        and server dial (this node's address when they run on env nodes)."""
        import zmq
        import zmq.asyncio

        super().__init__()
        self.spec = spec
        self.name = spec.name
        self.max_restarts = max_restarts
        self.restarts = 0
        self.zmq = zmq
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port(f"tcp://{bind_host}")
        self.spec = msgspec.structs.replace(spec, connect=f"tcp://{bind_host}:{port}")
        self.server = server if server is not None else LocalServer()
        self.calls: dict[int, tuple[asyncio.Future, Any, set[asyncio.Task]]] = {}
        self.next_rid = 0
        self.router = Router()
        self.checked = 0.0
        self.fatal: EnvServerFailed | None = None
        self.stopping = False  # the orchestrator is stopping (Setup.stopping): a server that ends is let go
        self.pids: dict[bytes, int] = {}  # worker ident -> pid (from its Ready): stall lines name it
        self.pinged = self.pong_at = 0.0
        self.ping_seq = 0
        self.reader: asyncio.Task | None = None
        self.ready: asyncio.Event | None = None
        self.outbox = Outbox(self.sock, routed=True)
        self._start()
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        self._apply(self._hello_blocking())

    # -- start / hello ----------------------------------------------------------------------------
    def _start(self) -> None:
        spec = msgspec.structs.replace(self.spec, restarts=self.restarts)
        self.server.start(spec)
        log.info(
            "env server %s/%s started (%s, %d workers)",
            spec.kind,
            spec.name,
            self.server.where(),
            spec.workers,
        )

    def _hello_blocking(self) -> wire.Hello:
        """Wait for the first Hello before any event loop runs (setup is synchronous)."""
        sync = self.zmq.Socket.shadow(self.sock.underlying)
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        while time.monotonic() < deadline:
            if sync.poll(200):
                ident, data = sync.recv_multipart()
                for msg in wire.decode(data):
                    if ident == server_ident(self.restarts):
                        return self._check_hello(msg)
                    self._early_ready(ident, msg)
                continue
            if self.server.exit_code() is not None:
                break
        self.close_now()
        raise EnvServerFailed(self._gone_msg("did not start"))

    def _early_ready(self, ident: bytes, msg: wire.Msg) -> None:
        """A worker can be ready before its server's Hello arrives."""
        if isinstance(msg, wire.Ready) and ident.startswith(f"w{self.restarts}.".encode()):
            self.router.ready(ident)

    def _check_hello(self, msg: wire.Msg) -> wire.Hello:
        if isinstance(msg, wire.LoadFailed):
            self.close_now()
            from hpcrl.envs.registry import EnvSpecError

            raise EnvSpecError(msg.error)
        assert isinstance(msg, wire.Hello), msg
        return msg

    def _apply(self, hello: wire.Hello) -> None:
        self.max_turns = hello.max_turns
        self.tools = hello.tools
        self._group_scored = hello.group_scored
        self._shares_first_turn = hello.shares_first_turn
        self._tasks = {s: [wire.from_wtask(t) for t in ts] for s, ts in hello.tasks.items()}
        self._task_errors = dict(hello.task_errors)

    def _gone_msg(self, what: str) -> str:
        code = self.server.exit_code()
        return (
            f"env server for {self.spec.kind} env {self.spec.name!r} {what}"
            f"{'' if code is None else f' (exit code {code})'}; see {server_log(self.spec.log_dir)}"
        )

    # -- Environment ------------------------------------------------------------------------------
    @property
    def group_scored(self) -> bool:
        return self._group_scored

    @property
    def shares_first_turn(self) -> bool:
        return self._shares_first_turn

    def tasks(self, split: str = "train", seed: int | None = None) -> Sequence[Task]:
        from hpcrl.envs.base import normalize_split

        split = normalize_split(split)
        if seed is not None:
            raise NotImplementedError(
                f"env {self.name!r} runs in an env server: it serves its own seed's tasks"
            )
        if split in self._task_errors:
            raise ValueError(self._task_errors[split])
        return self._tasks.get(split, [])

    async def rollout(self, task: Task, client: ChatClient, sampling: Mapping[str, Any]) -> Trajectory:
        return (await self._call(task, client, sampling, 1, group=False))[0]

    async def rollout_group(
        self, task: Task, client: ChatClient, sampling: Mapping[str, Any], n: int
    ) -> list[Trajectory]:
        return await self._call(task, client, sampling, n, group=True)

    # -- the wire ---------------------------------------------------------------------------------
    async def _call(
        self, task: Task, client: ChatClient, sampling: Mapping[str, Any], n: int, group: bool
    ) -> list[Trajectory]:
        self._ensure_reader()
        assert self.ready is not None
        await self.ready.wait()
        if self.fatal is not None:
            raise self.fatal
        self.next_rid += 1
        rid = self.next_rid
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self.calls[rid] = (fut, client, set())
        run = wire.Run(rid, wire.to_wtask(task), dict(sampling), n, group, self.system_prompt_override)
        try:
            ident = self.router.assign(rid, run, time.monotonic())
            if ident is not None:
                self._send(ident, run)
            done: wire.Done = await fut
        finally:
            _, _, chats = self.calls.pop(rid, (None, None, set()))
            for t in chats:
                t.cancel()
        if done.error is not None:
            raise EnvRolloutError(done.error)
        return [wire.from_wtraj(task, t) for t in done.trajectories]

    def _send(self, ident: bytes, msg: wire.Msg) -> None:
        self.outbox.put(msg, ident)  # leaves at the end of this loop iteration, with its neighbours

    def _ensure_reader(self) -> None:
        if self.reader is None:
            self.ready = asyncio.Event()
            self.ready.set()
            self.pong_at = time.monotonic()
            self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        while True:
            if await self.sock.poll(int(WATCH_S * 1000)):
                for ident, data in drain(self.sock, await self.sock.recv_multipart()):
                    for msg in wire.decode(data):
                        self._on(ident, msg)
            now = time.monotonic()
            if now - self.checked < WATCH_S:
                continue
            if now - self.checked > 5 * PING_S:  # this process did not run (stopped): no Pong could come
                self.pong_at = now
            self.checked = now
            if self.server.exit_code() is not None and self.stopping:
                self._ended()
                return
            if self.server.exit_code() is not None:
                await self._restart()
            elif self.spec.frozen_s > 0:
                await self._check_alive(now)
            for ident in self.router.overdue(now, self.spec.rollout_timeout_s):
                why = (
                    f"env worker {ident.decode()} killed: a rollout spent more than "
                    f"rollout_timeout_s={self.spec.rollout_timeout_s:g} s in env code"
                )
                self._fail(self.router.gone(ident), why)
                self._send(server_ident(self.restarts), wire.Kill(ident.decode(), why))

    def _on(self, ident: bytes, msg: wire.Msg) -> None:
        if isinstance(msg, wire.Chat):
            call = self.calls.get(msg.rid)
            if call is not None:
                self.router.asked_model(msg.rid)
                t = asyncio.ensure_future(self._answer(call[1], msg))
                call[2].add(t)
                t.add_done_callback(call[2].discard)
        elif isinstance(msg, wire.Done):
            self.router.done(msg.rid)
            call = self.calls.get(msg.rid)
            if call is not None and not call[0].done():
                call[0].set_result(msg)
        elif isinstance(msg, wire.Ready):
            if ident.startswith(f"w{self.restarts}.".encode()):  # not a worker of a dead server
                self.pids[ident] = msg.pid
                for run in self.router.ready(ident):
                    if run.rid in self.calls:
                        held = self.router.assign(run.rid, run, time.monotonic())
                        assert held is not None
                        self._send(held, run)
        elif isinstance(msg, wire.Pong):
            if ident == server_ident(self.restarts):
                self.pong_at = time.monotonic()
                if msg.lost:  # its log refused (disk full, quota): said here, where the console reads
                    log.warning(
                        "env server for %s env %r (pid %s): %s",
                        self.spec.kind,
                        self.name,
                        self.server.pid,
                        msg.lost,
                    )
        elif isinstance(msg, wire.WorkerDied):
            self._fail(self.router.gone(msg.ident.encode()), msg.why)
            # WARNING, not ERROR: survived; the launcher quotes a role's last ERROR line as why it ended
            log.warning("env %s/%s: %s", self.spec.kind, self.name, msg.why)

    def _fail(self, rids: list[int], why: str) -> None:
        for rid in rids:
            call = self.calls.get(rid)
            if call is not None and not call[0].done():
                call[0].set_exception(EnvComponentLost(why))

    async def _answer(self, client: ChatClient, msg: wire.Chat) -> None:
        from hpcrl.orchestrator.servers import InferenceUnavailable

        try:
            turn = await client.chat(msg.messages, msg.tools, msg.sampling)
            reply = wire.ChatReply(msg.rid, msg.seq, turn=wire.to_wturn(turn))
        except InferenceUnavailable as e:  # ends the run: the rollout's own await sees it
            call = self.calls.get(msg.rid)
            if call is not None and not call[0].done():
                call[0].set_exception(e)
            return
        except Exception as e:  # noqa: BLE001 - a failed request errors the rollout in the env
            reply = wire.ChatReply(msg.rid, msg.seq, error=f"{type(e).__name__}: {e}"[:500])
        ident = self.router.answered(msg.rid, time.monotonic())
        if ident is not None:  # else its worker is gone and the rollout already errored
            self._send(ident, reply)

    async def _check_alive(self, now: float) -> None:
        """Ping the server; one that answered none for spec.frozen_s (stopped, hung) is killed and
        restarted like a crashed one."""
        if now - self.pinged >= PING_S:
            self.pinged, self.ping_seq = now, self.ping_seq + 1
            self._send(server_ident(self.restarts), wire.Ping(self.ping_seq))
        silent = now - self.pong_at
        if silent <= self.spec.frozen_s:
            return
        pid = self.server.pid
        self.server.kill()
        await self._restart(
            f"env server for {self.spec.kind} env {self.spec.name!r} (pid {pid}) answered no ping for "
            f"{silent:.0f} s (> {self.spec.frozen_s:g} s, 2x stall_warning_s): frozen, killed; "
            f"see {server_log(self.spec.log_dir)}"
        )

    def busy_workers(self, now: float) -> list[tuple[str, float]]:
        """(description, seconds) of each worker holding a rollout in env code, longest first (read
        by the progress thread)."""
        ages: dict[bytes, tuple[int, float]] = {}
        for h in list(self.router.held.values()):
            if h.in_env_since is not None:
                n, age = ages.get(h.ident, (0, 0.0))
                ages[h.ident] = (n + 1, max(age, now - h.in_env_since))
        return [
            (
                f"env {self.name} worker {ident.decode().split('.')[1]} (pid {self.pids.get(ident, '?')}): "
                f"{n} rollout(s) in env code for {age:.0f} s",
                age,
            )
            for ident, (n, age) in sorted(ages.items(), key=lambda kv: -kv[1][1])
        ]

    def _ended(self) -> None:
        """The server ended while the orchestrator stops: what it held errors, and nothing restarts it."""
        why = self._gone_msg("ended while the orchestrator stops")
        log.info("%s; %d rollout(s) left unfinished", why, len(self.calls))
        self.router.clear()
        self.fatal = EnvServerFailed(why)
        for fut, _, _ in self.calls.values():
            if not fut.done():
                fut.set_exception(EnvComponentLost(why))
        if self.ready is not None:
            self.ready.set()

    async def _restart(self, why: str | None = None) -> None:
        """The server died (or was killed frozen: `why`): error what it held, start it again (or
        give up past max_restarts)."""
        assert self.ready is not None
        self.ready.clear()
        if why is None:  # named by its pid (or which start it was): one death, one event (causes.py)
            pid = self.server.pid
            why = f"{self._gone_msg('died')} ({f'it was pid {pid}' if pid else f'start {self.restarts + 1}'})"
        log.warning("%s; %d rollout(s) errored", why, len(self.calls))  # survived (see WorkerDied)
        self.router.clear()
        for fut, _, _ in self.calls.values():
            if not fut.done():
                fut.set_exception(EnvComponentLost(why))
        if self.restarts >= self.max_restarts:
            self.fatal = EnvServerFailed(
                f"{why}; restarted {self.restarts} time(s), the limit "
                f"(orchestrator.env_server_max_restarts) is reached"
            )
            self.ready.set()
            raise self.fatal
        self.restarts += 1
        self._start()
        deadline = time.monotonic() + HELLO_TIMEOUT_S
        while time.monotonic() < deadline:
            if await self.sock.poll(int(WATCH_S * 1000)):
                ident, data = await self.sock.recv_multipart()
                for msg in wire.decode(data):
                    if ident != server_ident(self.restarts):
                        self._early_ready(ident, msg)
                    elif isinstance(msg, (wire.Hello, wire.LoadFailed)):
                        self._apply(self._check_hello(msg))
                        self.pong_at = time.monotonic()
                        self.ready.set()
                        log.info(
                            "env server %s/%s restarted (restart %d)",
                            self.spec.kind,
                            self.name,
                            self.restarts,
                        )
                        return
            elif self.server.exit_code() is not None:
                break
        self.fatal = EnvServerFailed(self._gone_msg("could not be restarted"))
        self.ready.set()
        raise self.fatal

    # -- shutdown ---------------------------------------------------------------------------------
    async def aclose(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.reader
        self.close_now()

    def close_now(self) -> None:
        if self.sock.closed:
            return
        if self.server.exit_code() is None:
            sync = self.zmq.Socket.shadow(self.sock.underlying)
            for ident in [*self.router.workers, server_ident(self.restarts)]:
                with contextlib.suppress(Exception):
                    sync.send_multipart([ident, wire.encode(wire.Stop())], self.zmq.NOBLOCK)
        self.server.stop(timeout=3)  # also withdraws an env node's order
        self.sock.close()
        self.ctx.term()

    @property
    def pid(self) -> int | None:
        return self.server.pid


def status_file(log_dir: str | Path) -> Path:
    return Path(log_dir) / "components.json"


def server_spec(
    env_id: str,
    args: Mapping[str, Any],
    name: str,
    kind: str,
    workers: int,
    timeout_s: float,
    log_dir: Path,
    run_dir: str = "",
    index: int = 0,
    frozen_s: float = 0.0,
) -> wire.ServerSpec:
    return wire.ServerSpec(
        env_id=env_id,
        args=dict(args),
        name=name,
        kind=kind,
        workers=workers,
        rollout_timeout_s=timeout_s,
        connect="",
        log_dir=str(log_dir),
        status_file=str(status_file(log_dir)),
        run_dir=run_dir,
        index=index,
        frozen_s=frozen_s,
    )
