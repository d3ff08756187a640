"""The bus as the roles use it.

    bus = Bus(paths, role="trainer", rank=r)          # binds a doorbell, announces it
    batch = bus.wait_batch(step)                        # this rank's rollouts/step_N/rank_R
    ...
    bus.publish_policy(PolicyReady(step=step, ...))     # policy/step_N + ring the orchestrator

    bus = Bus(paths, role="orchestrator")
    bus.publish_batch(step, rank, batch)                # rollouts/step_N/rank_R + ring trainer_R
    policy = bus.wait_policy(step - max_async_level)    # newest policy >= that step

Every wait is bounded (per-call `timeout`, default `Bus.timeout`), wakes on the doorbell, and
rescans the directory at least every `poll_interval` seconds whatever the doorbell does. A wait is
interrupted by a Shutdown control message (ShutdownRequested). Corrupt files are moved into
RunPaths.rejected_dir, logged, listed in `Bus.rejected`, and the wait goes on.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from hpcrl.bus.doorbell import DoorbellReader, DoorbellWriter
from hpcrl.bus.errors import BusTimeout, CorruptMessageError, ShutdownRequested
from hpcrl.bus.files import (
    clean_stale_tmp,
    decode_json_file,
    ensure_dir,
    fsync_dir,
    read_message,
    reject,
    write_atomic,
    write_message,
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
        poll_interval: float = 0.5,
        timeout: float = 1800.0,
        check_shutdown: bool = True,
        durable: bool = True,
        checksum: str = DEFAULT_CHECKSUM,
        stale_tmp_age: float = 600.0,
    ):
        if not _SAFE_NAME.match(role):
            raise ValueError(f"bus role must match {_SAFE_NAME.pattern}, got {role!r}")
        if rank < 0:
            raise ValueError(f"bus rank must be >= 0, got {rank}")
        if not (math.isfinite(poll_interval) and poll_interval > 0):
            raise ValueError(f"bus poll_interval must be a positive number of seconds, got {poll_interval}")
        self.paths = paths
        self.role = role
        self.rank = rank
        self.name = endpoint_name(role, rank)
        self.poll_interval = poll_interval
        self.timeout = _check_timeout(timeout)
        self.check_shutdown = check_shutdown
        self.durable = durable
        self.checksum = checksum
        self.stale_tmp_age = stale_tmp_age
        self.rejected: list[Path] = []  # where corrupt files went, in order
        self.rings_received = 0
        self.last_renamed_at = 0.0  # time.time() right after the last publish's rename
        self._consumed: set[tuple[int, int]] = set()
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

        batch = self._wait(attempt, describe, timeout)
        self._consumed.add((step, rank))
        return batch

    # -- policy: trainer -> orchestrator ------------------------------------------------------
    def publish_policy(self, msg: PolicyReady) -> Path:
        path = self.paths.policy_file(msg.step)
        self.last_renamed_at = write_message(path, msg, checksum=self.checksum, durable=self.durable)
        # Trainer ranks publish policies and never wait for one: at 1,000 nodes ringing them would
        # cost 8,000 endpoint stats per step for nobody (docs/bus.md, paper model).
        self._writer.ring_all(Ring("policy", msg.step), exclude=self.name, skip_role="trainer")
        return path

    def latest_policy(self) -> PolicyReady | None:
        """The newest readable policy announcement, or None. Never blocks."""
        for step in reversed(RunPaths.steps_in(self.paths.policy_dir)):
            path = self.paths.policy_file(step)
            msg = self._read(path, PolicyReady)
            if msg is not None and msg.step != step:
                self._reject(CorruptMessageError(f"holds policy step {msg.step}", path))
                msg = None
            if msg is not None:
                return msg
        return None

    def wait_policy(self, step: int, timeout: float | None = None) -> PolicyReady:
        """The newest policy whose step is >= `step` (the orchestrator wants the freshest weights)."""

        def attempt() -> PolicyReady | None:
            msg = self.latest_policy()
            return msg if msg is not None and msg.step >= step else None

        def describe() -> str:
            newest = self.latest_policy()
            have = f"newest is step {newest.step}" if newest else "none published"
            return f"policy step >= {step} in {self.paths.policy_dir} ({have})"

        return self._wait(attempt, describe, timeout)

    # -- control -------------------------------------------------------------------------------
    def publish_control(self, msg: Shutdown) -> Path:
        if not isinstance(msg, Shutdown):
            raise ValueError(f"control messages are Shutdown, got {type(msg).__name__}")
        origin = re.sub(r"[^A-Za-z0-9_.-]", "_", msg.origin)
        path = self.paths.control_file(f"shutdown_{origin}")
        self.last_renamed_at = write_message(path, msg, checksum=self.checksum, durable=self.durable)
        self._writer.ring_all(Ring("control"), exclude=self.name)
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
        path = self.paths.server_file(info.index)
        write_atomic(path, [encode_json(info)], durable=self.durable)
        return path

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

        return self._wait(attempt, describe, timeout)

    # -- retention and resume -------------------------------------------------------------------
    def cleanup(self, before_step: int, keep: int = 0) -> list[Path]:
        """Delete consumed rollout steps < `before_step`, except the newest `keep` of them.

        Call it once every consumer of those steps is done (e.g. trainer rank 0 after the optimizer
        step: all ranks have read their shard by then). Policy files are tiny and kept.
        """
        if keep < 0:
            raise ValueError(f"cleanup keep must be >= 0, got {keep}")
        old = [s for s in RunPaths.steps_in(self.paths.rollouts_dir) if s < before_step]
        doomed = old[: len(old) - keep] if keep else old
        removed = []
        for s in doomed:
            d = self.paths.rollout_step_dir(s)
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
        self._clean_tmp()
        return removed

    def move_aside_after(self, step: int, tag: str) -> list[Path]:
        """Resume: move every rollout and policy file newer than `step`, and all control files,
        into RunPaths.moved_aside_dir(tag). Returns the new locations.

        Control files go too: a Shutdown from the run being resumed must not stop the new one.
        """
        if not _SAFE_NAME.match(tag):
            raise ValueError(f"move_aside tag must match {_SAFE_NAME.pattern}, got {tag!r}")
        dest_root = self.paths.moved_aside_dir(tag)
        moves: list[tuple[Path, Path]] = []
        for s in RunPaths.steps_in(self.paths.rollouts_dir):
            if s > step:
                d = self.paths.rollout_step_dir(s)
                moves.append((d, dest_root / "rollouts" / d.name))
        for s in RunPaths.steps_in(self.paths.policy_dir):
            if s > step:
                f = self.paths.policy_file(s)
                moves.append((f, dest_root / "policy" / f.name))
        for f in sorted(self.paths.control_dir.glob("*")):
            moves.append((f, dest_root / "control" / f.name))
        moved = []
        for src, dst in moves:
            ensure_dir(dst.parent)
            if dst.exists():
                dst = dst.with_name(f"{dst.name}.{time.time_ns()}")
            try:
                os.replace(src, dst)
            except FileNotFoundError:
                continue
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
    ) -> T:
        timeout = self.timeout if timeout is None else _check_timeout(timeout)
        start = time.monotonic()
        deadline = start + timeout
        while True:
            result = attempt()
            if result is not None:
                return result
            if self.check_shutdown and (stop := self.poll_control()) is not None:
                raise ShutdownRequested(stop)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                rejected = f"; rejected files: {[str(p) for p in self.rejected]}" if self.rejected else ""
                raise BusTimeout(
                    f"{self.name} waited {time.monotonic() - start:.1f}s for {describe()}; "
                    f"doorbell {self.address or 'off'} got {self.rings_received} ring(s){rejected}"
                )
            self._pause(min(self.poll_interval, remaining))

    def _pause(self, seconds: float) -> None:
        if self._reader is None:
            time.sleep(seconds)
        else:
            # The ring's content is not trusted: any ring just means "rescan now".
            self.rings_received += len(self._reader.wait(seconds))

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
        for d, recursive in (
            (self.paths.rollouts_dir, True),
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
