"""The bus as the roles use it.

    bus = Bus(paths, role="trainer", rank=r)          # binds a doorbell, announces it
    batch = bus.wait_batch(step)                        # this rank's rollouts/step_N/rank_R
    ...
    bus.publish_policy(PolicyReady(step=step, ...))     # policy/step_N + ring the orchestrator

    bus = Bus(paths, role="orchestrator")
    bus.publish_batch(step, rank, batch)                # rollouts/step_N/rank_R + ring trainer_R
    policy = bus.wait_policy(step - max_async_level)    # newest policy >= that step

Every wait is bounded (per-call `timeout`, default `Bus.timeout`), wakes on the doorbell, and
rescans the directory at least every `poll_interval` seconds whatever the doorbell does (2 s with a
doorbell, which is the primary wake-up; 0.5 s without). A wait is interrupted by a Shutdown control
message (ShutdownRequested): control/ is scanned at once on a "control" ring and otherwise every
`control_every` polls, so an idle rank costs the metadata server little (docs/bus.md, paper model). Corrupt files are moved into
RunPaths.rejected_dir, logged, listed in `Bus.rejected`, and the wait goes on.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from hpcrl.bus.doorbell import DoorbellReader, DoorbellWriter
from hpcrl.bus.errors import BusTimeout, CorruptMessageError, ShutdownRequested
from hpcrl.bus.files import (
    bus_entries,
    clean_stale_tmp,
    decode_json_file,
    ensure_dir,
    fsync_dir,
    read_message,
    reject,
    remove_bus_part,
    write_atomic,
    write_message,
    write_messages,
)
from hpcrl.bus.messages import (
    DEFAULT_CHECKSUM,
    M,
    PolicyReady,
    Ring,
    ServerInfo,
    Shutdown,
    TrainBatch,
    encode_json,
)
from hpcrl.paths import RunPaths

log = logging.getLogger("hpcrl.bus")

ROLLOUT_CONSUMER = "trainer"  # rollouts/step_N/rank_R is for endpoint "trainer_R"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")

T = TypeVar("T")
# Fallback rescan period of a wait. With a doorbell a ring wakes the reader within a millisecond and
# the rescan only covers lost rings, so it can be slow: at 8,000 waiting ranks every rescan is 8,000
# opens on the metadata server.
DOORBELL_POLL_S = 2.0
NO_DOORBELL_POLL_S = 0.5
_DUE_SLACK_S = 0.002  # a wake this close to a due rescan counts as due (poll timeouts are in ms)


def announce_server(
    paths: RunPaths,
    info: ServerInfo,
    *,
    writer: DoorbellWriter | None = None,
    exclude: str | None = None,
    durable: bool = True,
) -> Path:
    """Write bus/servers/server_I.json and ring every waiting reader: the orchestrator and, with the
    collective transport, trainer rank 0 (Bus.wait_servers). Without the ring a waiter sees the server
    only at its next fallback rescan (up to 2 s with a doorbell). Used by the server processes, which
    have no Bus of their own (a transient writer), and by Bus.announce_server."""
    path = paths.server_file(info.index)
    write_atomic(path, [encode_json(info)], durable=durable)
    _ring_waiters(paths, Ring("servers", info.index), writer, exclude)
    return path


def publish_control(
    paths: RunPaths,
    msg: Shutdown,
    *,
    writer: DoorbellWriter | None = None,
    exclude: str | None = None,
    durable: bool = True,
    checksum: str = DEFAULT_CHECKSUM,
) -> tuple[Path, float]:
    """Write control/shutdown_<origin> and ring every waiter ("control"). Used by Bus.publish_control
    and, with a transient writer, by the local launcher (which has no Bus). Returns (path, rename time)."""
    if not isinstance(msg, Shutdown):
        raise ValueError(f"control messages are Shutdown, got {type(msg).__name__}")
    origin = re.sub(r"[^A-Za-z0-9_.-]", "_", msg.origin)
    path = paths.control_file(f"shutdown_{origin}")
    renamed_at = write_message(path, msg, checksum=checksum, durable=durable)
    _ring_waiters(paths, Ring("control"), writer, exclude)
    return path, renamed_at


def _ring_waiters(paths: RunPaths, ring: Ring, writer: DoorbellWriter | None, exclude: str | None) -> None:
    """Ring every waiter through `writer`, or through a transient one (a process without a Bus)."""
    w = writer if writer is not None else DoorbellWriter(paths)
    try:
        w.ring_all(ring, exclude=exclude)
    finally:
        if writer is None:
            w.close(linger_ms=1000)  # the rings were queued before the connections were up


def endpoint_name(role: str, rank: int = 0) -> str:
    return f"{role}_{rank}"


class Bus:
    """One process's view of the run's message bus.

    role/rank name this process's doorbell (`<role>_<rank>`); `listen=False` for processes that
    only publish or only poll (their waits fall back to pure polling). `host` is the address the
    doorbell binds and advertises: "127.0.0.1" on one node, the node's IP (or "auto") across nodes;
    None reads $HPCRL_BUS_HOST (so a launcher can set it for every role), else "127.0.0.1".
    """

    def __init__(
        self,
        paths: RunPaths,
        role: str,
        rank: int = 0,
        *,
        host: str | None = None,
        listen: bool = True,
        poll_interval: float | None = None,
        timeout: float = 1800.0,
        check_shutdown: bool = True,
        durable: bool = True,
        checksum: str = DEFAULT_CHECKSUM,
        stale_tmp_age: float = 600.0,
        control_every: int = 4,
        publish_threads: int = 16,
        storage_timeout_s: float = 0.0,
    ):
        if not _SAFE_NAME.match(role):
            raise ValueError(f"bus role must match {_SAFE_NAME.pattern}, got {role!r}")
        if rank < 0:
            raise ValueError(f"bus rank must be >= 0, got {rank}")
        if poll_interval is None:
            poll_interval = DOORBELL_POLL_S if listen else NO_DOORBELL_POLL_S
        if not (math.isfinite(poll_interval) and poll_interval > 0):
            raise ValueError(f"bus poll_interval must be a positive number of seconds, got {poll_interval}")
        if control_every < 1:
            raise ValueError(f"bus control_every must be >= 1 poll, got {control_every}")
        if publish_threads < 1:
            raise ValueError(f"bus publish_threads must be >= 1, got {publish_threads}")
        self.paths = paths
        self.role = role
        self.rank = rank
        self.name = endpoint_name(role, rank)
        self.poll_interval = poll_interval
        # Without a doorbell a Shutdown is only ever found by scanning, so scan on every poll.
        self.control_interval = poll_interval * (control_every if listen else 1)
        self.publish_threads = publish_threads
        # How long publish_policy retries a write the filesystem refuses (hpcrl.storage: the run's
        # storage_timeout_s); 0 = a refusal raises at once.
        self.storage_timeout_s = storage_timeout_s
        self.timeout = _check_timeout(timeout)
        self.check_shutdown = check_shutdown
        self.durable = durable
        self.checksum = checksum
        self.stale_tmp_age = stale_tmp_age
        self.rejected: list[Path] = []  # where corrupt files went, in order
        self.rings_received = 0
        self.last_renamed_at = 0.0  # time.time() right after the last publish's rename
        self._consumed: set[tuple[int, int]] = set()
        self._control_due = 0.0  # time.monotonic() of the next scheduled scan of control/
        self._missed: tuple[Hashable, float] | None = None  # (what, when) the last look found nothing
        self._pool: ThreadPoolExecutor | None = None  # publish_batches' writers, made on first use
        self._cleaned_below = 0  # rollout steps below this hold no bus files (cleanup removed them)
        for d in (paths.endpoints_dir, paths.rollouts_dir, paths.policy_dir, paths.control_dir):
            ensure_dir(d)
        self._clean_tmp()
        self._writer = DoorbellWriter(paths)
        host = host or os.environ.get("HPCRL_BUS_HOST") or "127.0.0.1"
        self._reader = DoorbellReader(paths, self.name, host) if listen else None

    # -- event-loop integration (asyncio readers of the doorbell) ----------------------------------
    def ring_fd(self) -> int | None:
        """The doorbell's file descriptor for ``loop.add_reader`` (None without a doorbell). When it
        fires, call :meth:`rings_pending`; then rescan: a ring only means "something changed"."""
        return None if self._reader is None else self._reader.fileno()

    def rings_pending(self) -> bool:
        """Receive (and count) every queued ring without blocking; True if there was any, or if
        more are queued (so the caller rescans instead of sleeping)."""
        if self._reader is None:
            return False
        n = len(self._reader.wait(0))
        self.rings_received += n
        return n > 0 or self._reader.has_rings()

    @property
    def address(self) -> str | None:
        """tcp://host:port of this bus's doorbell, None if not listening."""
        return self._reader.address if self._reader else None

    # -- rollouts: orchestrator -> trainer rank R ----------------------------------------------
    def publish_batch(self, step: int, rank: int, batch: TrainBatch) -> Path:
        if (batch.step, batch.rank) != (step, rank):
            raise ValueError(
                f"batch is for step {batch.step} rank {batch.rank}, published as step {step} rank {rank}"
            )
        path = self.paths.rollout_file(step, rank)
        self.last_renamed_at = write_message(path, batch, checksum=self.checksum, durable=self.durable)
        self._writer.ring(endpoint_name(ROLLOUT_CONSUMER, rank), Ring("rollouts", step, rank))
        return path

    def publish_batches(self, step: int, batches: Sequence[TrainBatch]) -> list[Path]:
        """Every rank's batch of `step` at once: rollouts/step_N/rank_R for each, written by
        `publish_threads` threads (their fsyncs overlap) with one fsync of the step directory at the
        end instead of one per file; trainer_R is rung as its file lands. Each file is still atomic
        and complete before it is visible. Returns once every file is durable; on an error the
        files already renamed are complete and publishing the step again completes it."""
        ranks = [b.rank for b in batches]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"step {step} batches name a rank twice: ranks {sorted(ranks)}")
        for b in batches:
            if b.step != step:
                raise ValueError(f"batch is for step {b.step} rank {b.rank}, published as step {step}")
        items = [(self.paths.rollout_file(step, b.rank), b) for b in batches]

        def landed(i: int, renamed_at: float) -> None:
            self.last_renamed_at = max(self.last_renamed_at, renamed_at)
            rank = batches[i].rank
            self._writer.ring(endpoint_name(ROLLOUT_CONSUMER, rank), Ring("rollouts", step, rank))

        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.publish_threads, thread_name_prefix="bus-publish")
        write_messages(items, self._pool, checksum=self.checksum, durable=self.durable, on_renamed=landed)
        return [path for path, _ in items]

    def wait_batch(self, step: int, rank: int | None = None, timeout: float | None = None) -> TrainBatch:
        """This consumer's batch of `step` (exactly that file), once. BusTimeout if it does not come."""
        rank = self.rank if rank is None else rank
        if (step, rank) in self._consumed:
            raise ValueError(f"rollouts step {step} rank {rank} was already consumed by {self.name}")
        path = self.paths.rollout_file(step, rank)

        def attempt() -> TrainBatch | None:
            batch = self._read(path, TrainBatch)
            if batch is not None and (batch.step, batch.rank) != (step, rank):
                self._reject(CorruptMessageError(f"holds step {batch.step} rank {batch.rank}", path))
                return None
            return batch

        def describe() -> str:
            present = RunPaths.steps_in(self.paths.rollouts_dir)
            newest = f"step {present[-1]}" if present else "none"
            return f"rollouts step {step} rank {rank} at {path} (newest rollout step present: {newest})"

        batch = self._wait(attempt, describe, timeout, ("rollouts", step, rank))
        self._consumed.add((step, rank))
        return batch

    # -- policy: trainer -> orchestrator ------------------------------------------------------
    def publish_policy(self, msg: PolicyReady) -> Path:
        """Announce policy `msg.step` (policy/step_N + the LATEST hint + rings). A refused write is named
        once, retried up to storage_timeout_s (hpcrl.storage); write_policy: one try (trainer.publish)."""
        from hpcrl.storage import retry_blocking

        return retry_blocking(
            self.name, f"policy step {msg.step}", lambda: self.write_policy(msg), self.storage_timeout_s
        )

    def write_policy(self, msg: PolicyReady) -> Path:
        path = self.paths.policy_file(msg.step)
        self.last_renamed_at = write_message(path, msg, checksum=self.checksum, durable=self.durable)
        # The hint that makes latest_policy O(1); written after the file, so it never names a step
        # that is not there yet (a crash in between leaves it one behind, which readers detect).
        write_atomic(self.paths.policy_latest_file, [b"%d\n" % msg.step], durable=self.durable)
        # Trainer ranks publish policies and never wait for one: at 1,000 nodes ringing them would
        # cost 8,000 endpoint stats per step for nobody (docs/bus.md, paper model).
        self._writer.ring_all(Ring("policy", msg.step), exclude=self.name, skip_role="trainer")
        return path

    def latest_policy(self) -> PolicyReady | None:
        """The newest readable policy announcement, or None. Never blocks.

        Three lookups (policy/LATEST, no step after it, its file) instead of a listing of policy/;
        the listing remains the fallback when the hint is missing, behind or names a bad file.
        """
        hint = self._latest_policy_hint()
        if hint is not None and not self.paths.policy_file(hint + 1).exists():
            msg = self._policy_at(hint)
            if msg is not None:
                return msg
        for step in reversed(RunPaths.steps_in(self.paths.policy_dir)):
            msg = self._policy_at(step)
            if msg is not None:
                return msg
        return None

    def _latest_policy_hint(self) -> int | None:
        try:
            return int(self.paths.policy_latest_file.read_bytes())
        except (OSError, ValueError):  # absent, or torn by a crash before its rename was durable
            return None

    def _policy_at(self, step: int) -> PolicyReady | None:
        path = self.paths.policy_file(step)
        msg = self._read(path, PolicyReady)
        if msg is not None and msg.step != step:
            self._reject(CorruptMessageError(f"holds policy step {msg.step}", path))
            return None
        return msg

    def wait_policy(self, step: int, timeout: float | None = None) -> PolicyReady:
        """The newest policy whose step is >= `step` (the orchestrator wants the freshest weights)."""

        def attempt() -> PolicyReady | None:
            msg = self.latest_policy()
            return msg if msg is not None and msg.step >= step else None

        def describe() -> str:
            newest = self.latest_policy()
            have = f"newest is step {newest.step}" if newest else "none published"
            return f"policy step >= {step} in {self.paths.policy_dir} ({have})"

        return self._wait(attempt, describe, timeout, ("policy", step))

    # -- control -------------------------------------------------------------------------------
    def publish_control(self, msg: Shutdown) -> Path:
        path, self.last_renamed_at = publish_control(
            self.paths,
            msg,
            writer=self._writer,
            exclude=self.name,
            durable=self.durable,
            checksum=self.checksum,
        )
        return path

    def poll_control(self) -> Shutdown | None:
        """The earliest Shutdown published so far, or None. Control files are never consumed."""
        found: list[Shutdown] = []
        for path in sorted(self.paths.control_dir.glob("*.msgpack")):
            msg = self._read(path, Shutdown)
            if msg is not None:
                found.append(msg)
        return min(found, key=lambda m: m.created_at) if found else None

    # -- inference server addresses -------------------------------------------------------------
    def announce_server(self, info: ServerInfo) -> Path:
        return announce_server(self.paths, info, writer=self._writer, exclude=self.name, durable=self.durable)

    def servers(self) -> list[ServerInfo]:
        """Every readable server announcement, by index (unreadable ones are logged and skipped)."""
        out = []
        for path in sorted(self.paths.servers_dir.glob("server_*.json")):
            try:
                out.append(decode_json_file(path, ServerInfo))
            except FileNotFoundError:
                continue
            except CorruptMessageError as e:
                log.warning("skipping unreadable server announcement: %s", e)
        return sorted(out, key=lambda s: s.index)

    def wait_servers(self, count: int, timeout: float | None = None) -> list[ServerInfo]:
        """Block until `count` inference servers have announced themselves."""

        def attempt() -> list[ServerInfo] | None:
            found = self.servers()
            return found if len(found) >= count else None

        def describe() -> str:
            return f"{count} inference server(s) in {self.paths.servers_dir} (have {len(self.servers())})"

        return self._wait(attempt, describe, timeout, ("servers", count))

    # -- retention and resume -------------------------------------------------------------------
    def cleanup(self, before_step: int, keep: int = 0) -> list[Path]:
        """Delete consumed rollout steps < `before_step`, except the newest `keep` of them.

        Call it once every consumer of those steps is done (e.g. trainer rank 0 after the optimizer
        step: all ranks have read their shard by then). Policy announcements are pruned separately (prune_policies).
        """
        if keep < 0:
            raise ValueError(f"cleanup keep must be >= 0, got {keep}")
        steps = RunPaths.steps_in(self.paths.rollouts_dir)
        old = [s for s in steps if self._cleaned_below <= s < before_step and self._has_bus_files(s)]
        doomed = old[: len(old) - keep] if keep else old
        removed = []
        for s in doomed:
            d = self.paths.rollout_step_dir(s)
            remove_bus_part(d)  # saved rollouts (train/, eval/) stay: their retention is their own
            removed.append(d)
        kept = old[len(doomed) :]
        self._cleaned_below = kept[0] if kept else max(self._cleaned_below, before_step)
        self._clean_tmp()
        return removed

    def _has_bus_files(self, step: int) -> bool:
        entries = bus_entries(self.paths.rollout_step_dir(step))
        return entries is None or bool(entries)

    def prune_policies(self, before_step: int, keep_steps: Iterable[int] = ()) -> list[Path]:
        """Delete policy announcements of steps < `before_step`, except `keep_steps` and the newest
        one. The caller (trainer rank 0) knows what readers may still load: see
        hpcrl.trainer.publish. Keeps policy/ O(1) entries, so the fallback listing stays cheap."""
        steps = RunPaths.steps_in(self.paths.policy_dir)
        keep = set(keep_steps) | set(steps[-1:])
        removed = []
        for s in steps:
            if s < before_step and s not in keep:
                path = self.paths.policy_file(s)
                path.unlink(missing_ok=True)  # no directory fsync: a resurrected one is pruned again
                removed.append(path)
        return removed

    def move_aside_after(self, step: int, tag: str, *, republished: bool = False) -> list[Path]:
        """Resume: move every rollout and policy file newer than `step`, and all control files,
        into RunPaths.moved_aside_dir(tag). Returns the new locations.

        Control files go too: a Shutdown from the run being resumed must not stop the new one.
        `republished`: policy `step` too, because the resumed trainer announces it again. The old
        announcement names the dead run's broadcast, which retention may have deleted and which the
        new trainer replaces; the orchestrator must wait for (and verify) the new one.
        """
        if not _SAFE_NAME.match(tag):
            raise ValueError(f"move_aside tag must match {_SAFE_NAME.pattern}, got {tag!r}")
        dest_root = self.paths.moved_aside_dir(tag)
        moves: list[tuple[Path, Path]] = []
        for s in RunPaths.steps_in(self.paths.rollouts_dir):
            if s > step:
                d = self.paths.rollout_step_dir(s)
                entries = bus_entries(d)  # saved rollouts stay: the orchestrator rewrites its own
                if entries is None:
                    moves.append((d, dest_root / "rollouts" / d.name))
                moves += [(p, dest_root / "rollouts" / d.name / p.name) for p in entries or []]
        for s in RunPaths.steps_in(self.paths.policy_dir):
            if s > step or (republished and s == step):
                f = self.paths.policy_file(s)
                moves.append((f, dest_root / "policy" / f.name))
        for f in sorted(self.paths.control_dir.glob("*")):
            moves.append((f, dest_root / "control" / f.name))
        self.paths.policy_latest_file.unlink(missing_ok=True)  # may name a step moved aside
        moved = []
        for src, dst in moves:
            ensure_dir(dst.parent)
            if dst.exists():
                dst = dst.with_name(f"{dst.name}.{time.time_ns()}")
            try:
                os.replace(src, dst)
            except FileNotFoundError:
                continue
            except OSError as e:  # rollouts/ or policy/ on a filesystem of its own (a tmpfs, a link)
                if e.errno != errno.EXDEV:
                    raise
                shutil.move(src, dst)  # a copy, then the source removed: moved aside all the same
            fsync_dir(src.parent)
            fsync_dir(dst.parent)
            moved.append(dst)
        if moved:
            log.info("moved %d bus file(s) newer than step %d to %s", len(moved), step, dest_root)
        return moved

    # -- lifecycle -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._writer.close()

    def __enter__(self) -> Bus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Bus({self.name}, root={self.paths.root}, doorbell={self.address})"

    # -- internals -------------------------------------------------------------------------------
    def _wait(
        self,
        attempt: Callable[[], T | None],
        describe: Callable[[], str],
        timeout: float | None,
        what: Hashable,
    ) -> T:
        """Look (`attempt`) now, on every ring, and `poll_interval` after the last look otherwise.

        The schedule outlives one call: callers that wait in slices (the trainer, to stay responsive
        to a stop signal) do not look more often than one long wait would. control/ is scanned on a
        "control" ring and at least every `control_interval`. Rings are hints only ("look sooner");
        lost ones cost at most `poll_interval` for the file and `control_interval` for a Shutdown.
        """
        timeout = self.timeout if timeout is None else _check_timeout(timeout)
        start = time.monotonic()
        deadline = start + timeout
        look = timeout == 0 or not self._looked_within(what, start)
        looked = False
        while True:
            if look:
                looked = True
                result = attempt()
                if result is not None:
                    self._missed = None
                    return result
                self._missed = (what, time.monotonic())
            if self.check_shutdown and time.monotonic() >= self._control_due:
                self._control_due = time.monotonic() + self.control_interval
                if (stop := self.poll_control()) is not None:
                    raise ShutdownRequested(stop)
            now = time.monotonic()
            if now >= deadline:
                rejected = f"; rejected files: {[str(p) for p in self.rejected]}" if self.rejected else ""
                raise BusTimeout(
                    f"{self.name} waited {now - start:.1f}s for {describe()}; "
                    f"doorbell {self.address or 'off'} got {self.rings_received} ring(s){rejected}"
                )
            assert self._missed is not None
            due = self._missed[1] + self.poll_interval
            rings = self._pause(max(0.0, min(due, deadline) - now))
            now = time.monotonic()
            # A call that has not looked yet looks at its deadline: a timeout is never reported
            # without one look (a file that landed unrung), and slices that did look add none.
            look = bool(rings) or now >= due - _DUE_SLACK_S or (now >= deadline and not looked)
            if any(r.topic == "control" for r in rings):
                # Kept on the instance: if this same wake-up also finds the file and the wait returns,
                # the next wait still scans control/ first instead of up to control_interval later.
                self._control_due = 0.0

    def _looked_within(self, what: Hashable, now: float) -> bool:
        """The previous wait looked for exactly `what` less than one poll ago (and found nothing)."""
        return (
            self._missed is not None
            and self._missed[0] == what
            and now - self._missed[1] < self.poll_interval
        )

    def _pause(self, seconds: float) -> list[Ring]:
        if self._reader is None:
            time.sleep(seconds)
            return []
        rings = self._reader.wait(seconds)
        self.rings_received += len(rings)
        return rings

    def _read(self, path: Path, type: type[M]) -> M | None:
        try:
            return read_message(path, type)
        except FileNotFoundError:
            return None
        except CorruptMessageError as e:
            self._reject(e)
            return None

    def _reject(self, err: CorruptMessageError) -> None:
        assert err.path is not None
        dest = reject(err.path, self.paths.rejected_dir, self.paths.root, inode=err.inode)
        if dest is not None:
            self.rejected.append(dest)
            log.error("rejected corrupt bus file %s: %s (moved to %s)", err.path, err.reason, dest)

    def _clean_tmp(self) -> None:
        for s in RunPaths.steps_in(self.paths.rollouts_dir):  # not into saved rollouts: 10,000s of files
            if s >= self._cleaned_below - 1:
                clean_stale_tmp(self.paths.rollout_step_dir(s), max_age=self.stale_tmp_age)
        for d, recursive in (
            (self.paths.rollouts_dir, False),
            (self.paths.policy_dir, False),
            (self.paths.control_dir, False),
            (self.paths.endpoints_dir, False),
            (self.paths.servers_dir, False),
        ):
            clean_stale_tmp(d, max_age=self.stale_tmp_age, recursive=recursive)


def _check_timeout(timeout: float) -> float:
    if not (math.isfinite(timeout) and timeout >= 0):
        raise ValueError(f"bus timeouts must be finite and >= 0 seconds, got {timeout}")
    return float(timeout)
