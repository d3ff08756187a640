"""Publishing policy N: weights to the inference servers (files or a collective), then PolicyReady.

Filesystem transport: rank 0 writes broadcasts/step_N/model.safetensors (atomic dir rename) and then
publishes PolicyReady(path, checksum); servers load it when the orchestrator tells them to.
Collective transport: rank 0 publishes PolicyReady(transport="collective", checksum) and then
broadcasts the tensors (HF names, chunked) over the weight group the servers joined; the
orchestrator has them call /update_weights, which receives. Either way the checksum is computed
over exactly the tensors sent, and every server's checksum of what it loaded is compared to it.
The tensors are in ``dtype``, the trainer's compute dtype (bf16 over fp32 master weights on GPU):
what inference runs, cast once here, so the checksum covers the bytes sent and not the master copy.

Sharded (trainer.broadcast.sharded, the default): no rank gathers the policy; every rank writes its
own rows as files with a manifest, or broadcasts them to the servers itself: every trainer rank is a
member of the weight group (hpcrl.trainer.sharded_publish, docs/weights.md). What follows describes
the gathered path (`sharded = false`); over the collective transport the other trainer ranks take
part in the header's broadcast only (`_relay`). Delta sync travels as files only (config refuses it with the
collective transport).

LoRA: after the first (full, merged) policy, only the adapter travels, over either transport.

Delta sync (trainer.broadcast.delta): instead of the full weights, only the elements that changed
since the previous policy travel (hpcrl.weights.delta; broadcasts/step_N/delta.safetensors or the same
tensors over the collective, `base_step` in PolicyReady). A full sync is sent first, every
`full_every` policies, and whenever the delta would not be smaller.
Once the orchestrator reports a dead server (RunPaths.weights_fallback_file) the trainer switches to
files for good, starting with a full sync: see hpcrl.orchestrator.policy. With several trainer ranks
they decide together, once per publish and before the gather (`_agree_on_transport`), so that every
rank makes the same writes; a broadcast that fails (full weights or a LoRA adapter) is agreed on by
every rank (`_relay`) and the same policy is then written as files, every rank taking part.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from hpcrl import checkpoint
from hpcrl.bus import Bus, BusError, PolicyReady, read_message
from hpcrl.paths import RunPaths
from hpcrl.trainer.model import adapter_sync, hf_named_tensors
from hpcrl.weights.checksum import payload_bytes, state_dict_checksum
from hpcrl.weights.delta import DELTA_FILE, META_KEY, Delta, apply_delta, encode_delta

log = logging.getLogger("hpcrl.trainer")
T = TypeVar("T")


class PolicyPublisher:
    def __init__(
        self,
        paths: RunPaths,
        bus: Bus,
        rank: int,
        transport: str,
        keep: int,
        weight_group: Any = None,
        bucket_mb: float = 256,
        dtype: str | None = None,
        *,
        delta: bool = False,
        full_every: int = 20,
        sharded: bool = False,
        shard_bucket_mb: float = 256,
        resume_lag: int | None = None,
        storage_timeout_s: float = 0.0,
    ):
        assert transport in ("filesystem", "collective"), transport
        self.paths = paths
        self.bus = bus
        self.rank = rank
        self.transport = transport
        self.keep = max(2, keep)
        # How far before checkpoint C a resume from C loads policies: max_async_level (keep - 2).
        self.resume_lag = max(0, keep - 2) if resume_lag is None else resume_lag
        self._ckpt_seen: dict[int, tuple[int, str | None]] = {}  # checkpoint.newest_intact's memo
        self._bases: dict[int, int | None] = {}  # policy step -> its delta base (None: full)
        self.group = weight_group
        self.bucket_mb = bucket_mb
        self.dtype = dtype
        self.base_sent = False
        self.delta = delta
        self.full_every = max(1, full_every)
        # Delta sync: the last published policy (CPU copy, kept current by applying each delta to it)
        # with its step and checksum, and the step of the last full sync (the filesystem keeps it).
        self._prev: dict[str, torch.Tensor] | None = None
        self._prev_step = -1
        self._prev_checksum = ""
        self._last_full = -1
        self._adapter_base: int | None = None  # LoRA: the full policy the adapters apply to
        self.adapters_travel = True  # LoRA: policies after the first travel as the adapter alone
        self.last_sync_bytes = 0  # `weights/sync_bytes` of the newest publish (rank 0)
        # Sharded publish (filesystem, full policies): every rank writes its own rows
        # (hpcrl.trainer.sharded_publish); `last_rank_bytes` is what this rank wrote.
        self.sharded = sharded
        self.shard_bucket_mb = shard_bucket_mb
        self.last_rank_bytes = 0
        self.storage_timeout_s = storage_timeout_s  # hpcrl.storage: how long a refused write is retried
        # Rank 0's broadcast of a policy failed with several trainer ranks: its files, written once
        # every rank has agreed (_relay), so that they all take part in the writes' storage agreement.
        self._refile: Callable[[], None] | None = None

    def store(self, what: str, path: Path, write: Callable[[], T]) -> T:
        """`write()` (rank-local, no collective inside) under the storage policy: a write the
        filesystem refuses is named, retried with backoff from a clean start, and ends the trainer
        in one line past storage_timeout_s."""
        from hpcrl.storage import retry_blocking

        return retry_blocking("trainer", what, write, self.storage_timeout_s, path=path)

    def store_together(self, what: str, path: Path, write: Callable[[], T], *, each_own: bool = False) -> T:
        """`write()` on every trainer rank at once (collectives inside, or a rank-local part with
        `each_own`) under the storage policy: the ranks retry, wait and end together
        (hpcrl.storage.retry_together). Collective: every rank calls it."""
        from hpcrl.trainer.parallel import write_together

        return write_together("trainer", what, path, write, self.storage_timeout_s, each_own=each_own)

    def announce(self, step: int, msg: PolicyReady | None) -> None:
        """PolicyReady of policy `step` on the bus (policy/step_N), written by rank 0 (`msg`; None on
        the other ranks). Collective: every trainer rank calls it at the same point, so a write the
        filesystem refuses is retried by all of them, which wait and end on the same line (no rank
        left alone in the next collective: store_together)."""
        write = (lambda: self.bus.write_policy(msg)) if msg is not None else (lambda: None)
        self.store_together(f"policy step {step}", self.paths.policy_file(step), write)

    def publish(self, model: torch.nn.Module, step: int) -> float:
        """Collective over trainer ranks (FSDP gathers). Returns seconds spent; `last_sync_bytes` is what
        travelled (metric weights/sync_bytes)."""
        from hpcrl.models.load import is_peft_model

        # The first policy of a process goes in full (merged): the servers' base must be this trainer's
        # base (a warm start changes it); after that only the adapter changes, unless the adapter
        # cannot carry the change (hpcrl.trainer.model.adapter_sync): then every policy goes in full.
        if is_peft_model(model):
            if self.base_sent and self.adapters_travel:
                return self._publish_adapter(model, step)
            if not self.base_sent:
                self.adapters_travel, why = adapter_sync(model)  # collective
                self._adapter_base = step if self.adapters_travel else None
                if not self.adapters_travel:
                    log.info("LoRA: every policy is published in full (merged): %s", why)
        self.base_sent = True
        if self.sharded and (self.transport == "filesystem" or not self.delta):
            from hpcrl.trainer.sharded_publish import publish_collective, publish_sharded

            if self.transport == "filesystem":
                return publish_sharded(self, model, step)
            return publish_collective(self, model, step)
        t0 = time.perf_counter()
        collective = self.transport == "collective"
        if collective:
            self._agree_on_transport()  # every rank switches together: all or none relay below
            collective = self.transport == "collective"
        named = dict(hf_named_tensors(model, dtype=self.dtype))  # every rank iterates: shards are gathered
        if self.rank == 0:
            self.publish_named(named, step)
        else:  # rank 0 alone writes; every rank takes part in each write's storage agreement
            self._join_writes(step)
        if collective:
            self._relay(step)
        return time.perf_counter() - t0

    def _join_writes(self, step: int) -> None:
        """A rank other than 0 in publish_named's writes, in their order: the files (filesystem), then
        the announcement. Rank 0 writes; all retry, wait and end together (store_together)."""
        if self.transport == "filesystem":
            self.store_together(f"policy {step}", self.paths.broadcast_dir(step), lambda: None)
        self.announce(step, None)

    def _agree_on_transport(self) -> None:
        """Every trainer rank is in the weight group: all switch to files when rank 0 does (rank 0
        too, here: every rank then knows which writes this publish makes)."""
        from hpcrl.trainer.sharded_publish import _decide

        if _decide(self) == "filesystem":
            self._fall_back_to_files()

    def _relay(self, step: int, files: Callable[[], None] | None = None) -> None:
        """Collective transport, an update that rank 0 alone sends (the gathered path, a LoRA adapter):
        every other trainer rank is a member of the weight group and takes part in its header. Afterwards all
        ranks agree whether it failed somewhere; if so the later policies travel as files. When rank 0's
        broadcast failed, policy `step` is written as files now, every rank taking part: rank 0 runs
        `_refile`, the others `files` (default: their part in publish_named's writes, _join_writes)."""
        from hpcrl.trainer.parallel import all_reduce

        failed = self.transport != "collective"  # rank 0 fell back to files during this publish
        if self.rank != 0:
            from hpcrl.weights.collective import relay

            try:
                relay(self.group)
            except RuntimeError as e:
                log.warning("relaying rank 0's weight broadcast failed (%s)", str(e).splitlines()[0][:200])
                failed = True
        # one agreement: 1 = failed somewhere, 3 = rank 0's own broadcast failed (its files to write)
        code = float(failed) + 2.0 * (self._refile is not None)
        if self._world() > 1:
            code = float(all_reduce(code, op="max").item())
        if code > 0 and self.transport == "collective":
            self._fall_back_to_files()
        if code >= 3:  # rank 0 writes its files (`_refile`); the others join in (`files`)
            refile, self._refile = self._refile, None
            (refile or files or (lambda: self._join_writes(step)))()

    @staticmethod
    def _world() -> int:
        from hpcrl.trainer.sharded_publish import _world

        return _world()

    def publish_named(self, named: dict[str, torch.Tensor], step: int) -> float:
        """Rank 0 only: send `named` (HF names, full tensors) as policy `step`. Seconds spent. With
        several trainer ranks (publish) the others take part in its writes meanwhile (_join_writes)."""
        t0 = time.perf_counter()
        if (
            self.transport == "collective"
            and self._world() == 1
            and self.paths.weights_fallback_file.exists()
        ):
            # A server died (the orchestrator says so): the group has a dead member and cannot take
            # in its restarted process, so every later policy travels as files, from a full one on.
            # Several trainer ranks: publish() decided for all of them before the gather
            # (_agree_on_transport); rank 0 deciding again here alone would make writes the others
            # do not join (store_together) and leave them in _relay's agreement: a hang.
            log.warning(
                "a server of the weight group died: publishing policies as files from step %d on", step
            )
            self._fall_back_to_files()
        checksum = state_dict_checksum(named)
        nbytes = payload_bytes(named)
        nparams = sum(t.numel() for t in named.values())
        delta = self._encode(named, step)
        self.last_sync_bytes = delta.nbytes if delta is not None else nbytes
        base = delta.base_step if delta is not None else None

        def announce(transport: str, path: Path | None, base_step: int | None, sync_bytes: int) -> None:
            self._bases[step] = base_step
            self.announce(
                step,
                PolicyReady(
                    step=step,
                    transport=transport,
                    path=None if path is None else str(path),
                    checksum=checksum,
                    num_params=nparams,
                    num_bytes=nbytes,
                    base_step=base_step,
                    sync_bytes=sync_bytes,
                ),
            )

        if self.transport == "filesystem":
            announce("filesystem", self._write_files(step, named, delta), base, self.last_sync_bytes)
        else:
            from hpcrl.weights.collective import broadcast_weights

            announce("collective", None, base, self.last_sync_bytes)
            try:
                if delta is None:
                    broadcast_weights(self.group, named, step, bucket_mb=self.bucket_mb, checksum=checksum)
                else:
                    broadcast_weights(
                        self.group,
                        delta.tensors,
                        step,
                        bucket_mb=self.bucket_mb,
                        checksum=checksum,
                        delta=delta.manifest(),
                    )
            except RuntimeError as e:  # a receiver died mid-broadcast (gloo/NCCL: connection closed)
                log.warning(
                    "weight broadcast of policy %d failed (%s): publishing it and every later policy "
                    "as files",
                    step,
                    str(e).splitlines()[0][:200],
                )
                self._fall_back_to_files()  # survivors waiting for the rest of this broadcast fail at once
                delta, self.last_sync_bytes = None, nbytes

                def refile() -> None:  # same tensors, same checksum; replaces the collective announcement
                    announce("filesystem", self._write_files(step, named, None), None, nbytes)

                if self._world() > 1:  # after the ranks agree (_relay): every rank takes part
                    self._refile = refile
                else:
                    refile()
        self._remember(named, step, checksum, delta)
        self._clean_behind(step)
        dt = time.perf_counter() - t0
        log.info(
            "policy %d published (%s, %s %.1f MB of %.1f MB, %.2fs, checksum %s)",
            step,
            self.transport,
            "delta" if delta is not None else "full",
            self.last_sync_bytes / 1e6,
            nbytes / 1e6,
            dt,
            checksum[:12],
        )
        return dt

    def _fall_back_to_files(self) -> None:
        """Files from now on; the next delta needs a full base the files hold, so start over."""
        from hpcrl.weights.collective import destroy_group

        self.transport = "filesystem"
        self._prev, self._prev_step, self._last_full = None, -1, -1
        if self.group is not None:
            destroy_group(self.group)
            self.group = None  # the last reference: gloo closes its connections

    def _publish_adapter(self, model: torch.nn.Module, step: int) -> float:
        """LoRA: only the adapter travels, in peft's format (what /load_lora_adapter reads in vLLM and the
        embedded engine): files under broadcasts/step_N, or its tensors over the weight group with the
        adapter config in the header (servers merge it in /update_weights). The checksum is over the
        adapter's tensors, which is what a server reports after merging them. Collective transport:
        files from the first adapter after a server died (every rank agrees first), and an adapter
        whose broadcast fails goes out again as files, every rank taking part (as publish_named)."""
        from hpcrl.trainer.model import adapter_config, adapter_tensors

        t0 = time.perf_counter()
        if self.transport == "collective":
            self._agree_on_transport()  # a dead server: every rank switches to files together
        adapter = adapter_tensors(model)  # collective under FSDP
        if self.transport == "filesystem":
            checksum = self._adapter_files(model, adapter, step)
        else:
            self.last_sync_bytes = payload_bytes(adapter)
            checksum, msg = (state_dict_checksum(adapter) if self.rank == 0 else ""), None

            def files() -> None:  # same tensors, same checksum; replaces the collective announcement
                self._adapter_files(model, adapter, step)

            if self.rank == 0:
                msg = self._adapter_ready(step, "collective", None, adapter, checksum)
            self.announce(step, msg)  # every rank: refused, all wait and end together
            if self.rank == 0:
                from hpcrl.weights.collective import broadcast_weights

                try:
                    broadcast_weights(
                        self.group,
                        adapter,
                        step,
                        bucket_mb=self.bucket_mb,
                        checksum=checksum,
                        adapter=adapter_config(model),
                    )
                except RuntimeError as e:  # a receiver died mid-broadcast (gloo/NCCL: connection closed)
                    log.warning(
                        "weight broadcast of policy %d (LoRA adapter) failed (%s): publishing it and "
                        "every later policy as files",
                        step,
                        str(e).splitlines()[0][:200],
                    )
                    self._fall_back_to_files()  # the other ranks waiting in the header fail at once
                    self._refile = files
            # every rank agrees whether it failed; rank 0's broadcast failed: all write its files now
            self._relay(step, files=files)
        if self.rank != 0:
            return time.perf_counter() - t0
        self._clean_behind(step)
        dt = time.perf_counter() - t0
        log.info(
            "policy %d published (LoRA adapter, %s, %.3f MB, %.2fs, checksum %s)",
            step,
            self.transport,
            self.last_sync_bytes / 1e6,
            dt,
            checksum[:12],
        )
        return dt

    def _adapter_files(self, model: torch.nn.Module, adapter: dict[str, torch.Tensor], step: int) -> str:
        """The adapter as files (broadcasts/step_N) and their announcement; every trainer rank calls it
        (rank 0 writes: a refused write is waited out and ends every rank together). Returns the
        checksum of what was written (rank 0; "" elsewhere)."""
        from hpcrl.trainer.model import write_adapter

        path = self.paths.broadcast_dir(step)
        rank0 = self.rank == 0
        # tmp dir renamed last: never half there
        self.store_together(
            f"policy {step} (LoRA adapter)",
            path,
            lambda: write_adapter(model, adapter, path) if rank0 else None,
        )
        checksum, msg = "", None
        if rank0:
            from safetensors.torch import load_file

            tensors = load_file(str(path / "adapter_model.safetensors"))  # the checksum: what was written
            self.last_sync_bytes = sum(f.stat().st_size for f in path.iterdir())
            checksum = state_dict_checksum(tensors)
            msg = self._adapter_ready(step, "filesystem", path, tensors, checksum)
        self.announce(step, msg)  # every rank: refused, all wait and end together
        return checksum

    def _adapter_ready(
        self, step: int, transport: str, path: Path | None, tensors: dict[str, torch.Tensor], checksum: str
    ) -> PolicyReady:
        return PolicyReady(
            step=step,
            transport=transport,
            path=None if path is None else str(path),
            checksum=checksum,
            adapter=True,
            num_params=sum(t.numel() for t in tensors.values()),
            num_bytes=self.last_sync_bytes,
            sync_bytes=self.last_sync_bytes,
        )

    def _encode(self, named: dict[str, torch.Tensor], step: int) -> Delta | None:
        """The delta from the previous policy, or None for a full sync (first, periodic, or not smaller)."""
        if (
            not self.delta
            or self._prev is None
            or self._prev_step >= step
            or step - self._last_full >= self.full_every
        ):
            return None
        delta = encode_delta(self._prev, named, self._prev_step, self._prev_checksum)
        return delta if delta.nbytes < payload_bytes(named) else None

    def _remember(
        self, named: dict[str, torch.Tensor], step: int, checksum: str, delta: Delta | None
    ) -> None:
        if not self.delta:
            return
        if delta is None or self._prev is None:
            self._prev = {k: v.detach().to("cpu", copy=True) for k, v in named.items()}
            self._last_full = step
        else:
            apply_delta(self._prev, delta)  # touches only the changed elements
        self._prev_step, self._prev_checksum = step, checksum

    def _write_files(self, step: int, named: dict[str, torch.Tensor], delta: Delta | None):
        from safetensors.torch import save_file

        from hpcrl.fileio import atomic_dir

        final = self.paths.broadcast_dir(step)

        def write() -> None:
            # the server never sees a half-written broadcast; a retry starts from a fresh tmp dir
            with atomic_dir(final) as tmp:
                if delta is None:
                    save_file(
                        {k: v.contiguous() for k, v in named.items()},
                        str(tmp / "model.safetensors"),
                        metadata={"format": "pt"},
                    )
                else:
                    save_file(
                        delta.tensors,
                        str(tmp / DELTA_FILE),
                        metadata={"format": "pt", META_KEY: delta.manifest_json()},
                    )

        # every trainer rank takes part (rank 0 writes): refused, all wait and end together
        self.store_together(f"policy {step}", final, write)
        return final

    def _clean_behind(self, step: int) -> None:
        """Retention of what policy `step` made old: broadcasts (filesystem transport) and policy/
        announcements, which would otherwise grow by one file per step (docs/bus.md, paper model).

        What a reader can still ask for, so what stays:
        - the newest `keep` (max_async_level + 2) policies: the orchestrator is at most
          max_async_level steps behind (PolicySync.exact, `ensure`'s in-order collective loads,
          reviving a server with the policy it holds);
        - with delta sync, everything since the last full policy: a server that loads policy N
          after missing some replays the chain from there (PolicySync._delta_chain);
        - what a resume needs (`_resume_pins`): files and announcements of policies C - max_async_level
          .. C for every checkpoint C a resume may pick, and with LoRA (announcement only) the full
          policy the adapters apply to.
        """
        floor = step - self.keep
        if self.delta and self._last_full >= 0:
            floor = min(floor, self._last_full - 1)
        pinned = self._resume_pins()
        if self.transport == "filesystem":
            for s in RunPaths.steps_in(self.paths.broadcasts_dir):
                if s <= floor and s not in pinned:
                    shutil.rmtree(self.paths.broadcast_dir(s), ignore_errors=True)
        if self._adapter_base is not None:
            pinned.add(self._adapter_base)
        self.bus.prune_policies(before_step=floor + 1, keep_steps=pinned)
        oldest = min(pinned | {floor})
        self._bases = {s: b for s, b in self._bases.items() if s >= oldest}

    def _resume_pins(self) -> set[int]:
        """Policies a resume loads again: a deterministic orchestrator resumed from checkpoint C at
        batch B >= C generates batch B+1 with exactly policy B - max_async_level, which can be as old as
        C - max_async_level. The trainer restores only C's weights, so the older policies must still be
        on disk (bitwise losslessness; docs/architecture.md §4). Pinned for the newest intact
        checkpoint and every newer one being written (checkpoint.resumable: a kill while C+k is half
        written resumes from C), with the delta chains those policies are built on."""
        pins: set[int] = set()
        for c in checkpoint.resumable(self.paths, self._ckpt_seen):
            pins.update(range(max(0, c - self.resume_lag), c + 1))
        if not self.delta:
            return pins
        todo = list(pins)
        while todo:
            base = self._base_of(todo.pop())
            if base is not None and base not in pins:
                pins.add(base)
                todo.append(base)
        return pins

    def _base_of(self, step: int) -> int | None:
        """The delta base of policy `step` (None: a full policy, or no announcement left to ask)."""
        if step not in self._bases:
            try:
                self._bases[step] = read_message(self.paths.policy_file(step), PolicyReady).base_step
            except (FileNotFoundError, BusError):
                return None
        return self._bases[step]
