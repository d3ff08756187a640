"""The trainer's checkpointer: which steps are saved, what a save writes, and the background
finalisation that writes COMPLETE last (in the spirit of torchtitan's CheckpointManager).

    restore(initial)          -> (step, Progress) of ckpt.resume_step, state loaded into the model
                                 (not the optimizer / scheduler with ckpt.skip_optimizer / skip_scheduler);
                                 (0, initial) else, with a warm start's optimizer state when asked
    maybe_save(step, progress, force)   every ckpt.interval steps, at the final step, and when forced
      -> weights/step_N (HF dir, per ckpt.hf_weights) + checkpoints/step_N/trainer/ (+ trainer/hf/:
         what `hpcrl export` needs) -> rank 0: finaliser thread waits for
         every part (RL: trainer + orchestrator; SFT: trainer), writes COMPLETE, applies retention
    maybe_save_adapter(step)  LoRA adapters/step_N every ckpt.adapter_interval steps and at the end
    close()                   waits for the finalisers still running

Retention never deletes a step whose finaliser is still waiting: with fast steps, step N+1 can
complete while step N still waits for the orchestrator's part.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from hpcrl import checkpoint
from hpcrl.config.schema import CkptConfig
from hpcrl.fileio import WriteRefused, refused_write
from hpcrl.paths import RunPaths
from hpcrl.trainer import parallel
from hpcrl.trainer.core import Progress
from hpcrl.trainer.setup import Training
from hpcrl.trainer.state import load_trainer_state, save_trainer_state

log = logging.getLogger("hpcrl.trainer")
T = TypeVar("T")


class Checkpointer:
    def __init__(
        self,
        cfg: CkptConfig | None,
        paths: RunPaths,
        tr: Training,
        max_steps: int,
        *,
        parts: tuple[str, ...] = checkpoint.PARTS,
        finalize_timeout_s: float = 600.0,
        storage_timeout_s: float = 0.0,
        role: str = "trainer",
    ):
        self.cfg, self.paths, self.tr, self.max_steps = cfg, paths, tr, max_steps
        self.parts = parts  # the parts COMPLETE waits for
        self.finalize_timeout_s = finalize_timeout_s
        self.storage_timeout_s, self.role = storage_timeout_s, role  # hpcrl.storage's policy
        self.last_saved: int | None = None
        self._finalizing: set[int] = set()  # steps whose COMPLETE this process has yet to write
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._hf: bool | None = None  # ckpt.hf_weights, decided at the first save

    # -- restore -----------------------------------------------------------------------------
    def restore(self, initial: Progress) -> tuple[int, Progress]:
        """(step, progress) of ``ckpt.resume_step``, with model/optimizer/scheduler/RNG restored;
        (0, ``initial``) without one."""
        if self.cfg is None:
            return 0, initial
        if self.cfg.resume_step is None:
            if self.cfg.warm_start and self.cfg.warm_start_optimizer:
                self._warm_start_optimizer(self.cfg.warm_start)
            return 0, initial
        step = checkpoint.resolve_resume_step(self.paths, self.cfg.resume_step)
        tr, c = self.tr, self.cfg
        saved = load_trainer_state(
            self.paths,
            step,
            tr.dist.rank,
            tr.dist.world_size,
            tr.model,
            tr.optimizer,
            tr.scheduler,
            load_optimizer=not c.skip_optimizer,
            load_scheduler=not c.skip_scheduler,
        )
        if c.skip_scheduler and tr.make_scheduler is not None:
            # a fresh schedule over the remaining steps (warmup again), as prime-rl; the first
            # resumed step uses its step-0 learning rate
            tr.scheduler = tr.make_scheduler(max(self.max_steps - step, 1))
        skipped = [n for n, s in (("optimizer", c.skip_optimizer), ("scheduler", c.skip_scheduler)) if s]
        log.info(
            "resumed trainer state from %s%s",
            self.paths.checkpoint_dir(step),
            f" (fresh {' and '.join(skipped)}: ckpt.skip_{'/skip_'.join(skipped)})" if skipped else "",
        )
        self.last_saved = step
        return step, Progress.from_saved(saved)

    def _warm_start_optimizer(self, ref: str) -> None:
        """Warm start with ``ckpt.warm_start_optimizer``: the source checkpoint's optimizer state
        into this run's optimizer; step 0, fresh scheduler and progress (a resume of this run itself
        takes its own state instead)."""
        from hpcrl.trainer.state import load_optimizer_moments
        from hpcrl.warm_start import optimizer_source

        src, step = optimizer_source(ref)
        tr = self.tr
        try:
            load_optimizer_moments(src, step, tr.dist.rank, tr.dist.world_size, tr.optimizer)
        except ValueError as e:
            raise checkpoint.CheckpointError(f"ckpt.warm_start_optimizer: {e}") from None
        log.info("warm start: optimizer state from %s", src.checkpoint_dir(step))

    # -- what is due ---------------------------------------------------------------------------
    def due(self, step: int, force: bool = False) -> bool:
        """Every ``ckpt.interval`` steps, at the final step, and when forced (stop signal, early
        stop); never twice for the same step."""
        if self.cfg is None or step == self.last_saved:
            return False
        return force or checkpoint.is_due(step, self.max_steps, self.cfg.interval)

    def adapter_due(self, step: int) -> bool:
        from hpcrl.models.load import is_peft_model

        c = self.cfg
        if c is None or not c.adapter_interval or not is_peft_model(self.tr.model):
            return False
        return step % c.adapter_interval == 0 or step == self.max_steps

    # -- saving ----------------------------------------------------------------------------------
    def maybe_save(self, step: int, progress: Progress, force: bool = False) -> float:
        """Save when due (collective: every rank calls it). Returns seconds spent."""
        return self.save(step, progress) if self.due(step, force) else 0.0

    def save(self, step: int, progress: Progress) -> float:
        """HF weights + this rank's trainer part; rank 0 then finalises in the background. Seconds spent."""
        assert self.cfg is not None
        t0 = time.perf_counter()
        self.last_saved = step
        rank, world, paths, tr = self.tr.dist.rank, self.tr.dist.world_size, self.paths, self.tr
        what = f"checkpoint step {step}"
        # Every rank's writes go through store_together: refused on any rank, all ranks retry, wait
        # and end together (no rank is left in a collective). A retry writes weights/step_N afresh,
        # every rank in step (its rows come to rank 0 by collectives).
        self.store_together(f"{what} (weights)", paths.weights_dir(step), lambda: self._save_weights(step))
        if self.cfg.weights_only:
            return time.perf_counter() - t0
        # step_N has no COMPLETE until every part is done: a resume skips it meanwhile; a retried part
        # starts from an empty directory (begin_part clears it)
        part = paths.trainer_ckpt_dir(step)

        def begin() -> None:  # rank 0; the others wait for it (the agreement is the barrier)
            if rank != 0:
                return
            # config, tokenizer and the HF names of every state key: `hpcrl export` needs no more
            from hpcrl.trainer.export import write_meta

            checkpoint.begin_part(paths, step, "trainer", clear=True)
            write_meta(tr.model, tr.tokenizer, part / "hf", tr.precision.compute)

        self.store_together(what, part, begin)
        state = progress.to_saved()

        def mine() -> None:  # this rank's files, then its DONE marker (rank-local)
            save_trainer_state(paths, step, rank, world, tr.model, tr.optimizer, tr.scheduler, state)
            checkpoint.mark_part_done(paths, step, "trainer", rank=rank)

        self.store_together(what, part, mine, each_own=True)
        if rank == 0:
            self._start_finalizer(step)
        return time.perf_counter() - t0

    def store(self, what: str, path: Path, write: Callable[[], T]) -> T:
        """`write()` (rank-local) under the storage policy (hpcrl.storage): named, retried, one line
        past storage_timeout_s."""
        from hpcrl.storage import retry_blocking

        return retry_blocking(self.role, what, write, self.storage_timeout_s, path=path)

    def store_together(self, what: str, path: Path, write: Callable[[], T], *, each_own: bool = False) -> T:
        """`write()` on every rank at once under the storage policy (parallel.write_together):
        refused anywhere, the ranks retry, wait and end together. Collective."""
        return parallel.write_together(
            self.role, what, path, write, self.storage_timeout_s, each_own=each_own
        )

    def stop_summary(self, step: int) -> str:
        """What a stop after `step` leaves for a resume, for the exit log line."""
        if self.cfg is None:
            return f"no checkpoint of step {step} (checkpointing is off: [ckpt] unset)"
        if self.last_saved != step:
            return f"no checkpoint of step {step} written"
        if self.cfg.weights_only:
            return f"saved weights of step {step} only (ckpt.weights_only: no resumable checkpoint)"
        return f"checkpointed step {step}"

    def maybe_save_adapter(self, step: int) -> bool:
        """LoRA: the adapter alone (peft format) under adapters/step_N when due (the hosted shape's
        ``[adapters] interval``). Collective under FSDP."""
        if not self.adapter_due(step):
            return False
        from hpcrl.trainer.model import adapter_tensors, write_adapter

        tensors, out = adapter_tensors(self.tr.model), self.paths.adapter_dir(step)  # collective under FSDP
        rank0 = self.tr.dist.rank == 0
        # rank 0 writes (tmp dir renamed last: never half there); refused, every rank waits with it and
        # all end in its line past the bound, instead of the others timing out in the next collective
        self.store_together(
            f"LoRA adapter step {step}",
            out,
            lambda: write_adapter(self.tr.model, tensors, out) if rank0 else None,
        )
        return True

    def writes_hf_weights(self) -> bool:
        """ckpt.hf_weights for this run's policy size (hpcrl.checkpoint.writes_hf_weights), said once."""
        if self._hf is None:
            assert self.cfg is not None
            tr = self.tr
            from hpcrl.models.load import parse_dtype

            size = sum(p.numel() for p in tr.model.parameters()) * parse_dtype(tr.precision.compute).itemsize
            self._hf = checkpoint.writes_hf_weights(self.cfg.hf_weights, self.cfg.weights_only, size)
            if not self._hf and tr.dist.rank == 0:
                log.info(
                    "checkpoints: no weights/step_N (ckpt.hf_weights = %s, policy %.1f GB): "
                    "`hpcrl export %s/step_N` writes them from a checkpoint",
                    self.cfg.hf_weights,
                    size / 1e9,
                    self.paths.checkpoints_dir,
                )
        return self._hf

    def _save_weights(self, step: int) -> None:
        from hpcrl.models.load import is_peft_model
        from hpcrl.trainer.model import adapter_tensors, write_adapter
        from hpcrl.trainer.stream import export_hf_streamed

        if not self.writes_hf_weights():
            return
        tr, rank = self.tr, self.tr.dist.rank
        # The adapter's gather first (every rank: collective under FSDP): an export that rank 0 fails
        # (refused write) must not leave the other ranks in a gather rank 0 never enters.
        adapter = self.cfg is not None and self.cfg.save_adapter_separately and is_peft_model(tr.model)
        tensors = adapter_tensors(tr.model) if adapter else None
        # no rank gathers the model: rank 0 writes the tensors as the ranks' rows arrive (hpcrl.trainer.stream)
        export_hf_streamed(
            tr.model, tr.tokenizer, str(self.paths.weights_dir(step)), rank=rank, dtype=tr.precision.compute
        )
        if tensors is not None and rank == 0:
            write_adapter(tr.model, tensors, self.paths.weights_dir(step) / "adapter")

    # -- finalisation ----------------------------------------------------------------------------
    def _start_finalizer(self, step: int) -> None:
        with self._lock:
            self._finalizing.add(step)
        th = threading.Thread(target=self._finalize, args=(step,), name=f"ckpt-finalize-{step}", daemon=False)
        th.start()
        self._threads.append(th)

    def _finalize(self, step: int) -> None:
        """Wait for every part, write COMPLETE, then apply retention (sparing steps still waiting)."""
        assert self.cfg is not None
        try:
            world = self.tr.dist.world_size
            done = self.store(
                f"checkpoint step {step} (COMPLETE)",
                self.paths.complete_file(step),
                lambda: checkpoint.finalize_when_ready(
                    self.paths, step, self.parts, world, self.finalize_timeout_s
                ),
            )
            if done is None:
                return
            log.info("checkpoint step_%d complete", step)
            with self._lock:
                busy = self._finalizing - {step}
                removed = checkpoint.apply_retention(
                    self.paths, self.cfg.keep_last, self.cfg.keep_interval, in_progress=busy
                )
            for s in removed:
                shutil.rmtree(self.paths.weights_dir(s), ignore_errors=True)
        except WriteRefused as e:  # past storage_timeout_s: no COMPLETE, the previous step stays usable
            log.error("checkpoint step_%d not completed: %s", step, e)
        except OSError as e:  # retention refused (read-only storage): it runs again after the next one
            if refused_write(e) is None:
                raise
            log.warning("checkpoint retention after step_%d skipped: %s", step, refused_write(e))
        finally:
            with self._lock:
                self._finalizing.discard(step)

    def finalizing(self) -> set[int]:
        with self._lock:
            return set(self._finalizing)

    def close(self) -> None:
        """Wait for every finaliser (each is bounded by ``finalize_timeout_s``)."""
        for th in self._threads:
            th.join()
        self._threads.clear()
