"""`hpcrl orchestrator`: generate, score and publish one batch per training step.

    set up (model, tokenizer, envs, buffer) -> find the servers -> restore a checkpoint (resume)
    -> load + verify the start policy -> for each step:
         wait for a fresh-enough policy -> generate + score + filter groups until the batch is full
         -> pack one TrainBatch per trainer rank and publish it -> metrics
         -> at the boundary: checkpoint parts that are due, eval, validation
    -> wait for the final policy, last checkpoint part, final eval -> exit 0

Async: batch `step` may be generated with any policy >= step-1-max_async_level. Without
`deterministic` a watcher loads every new policy into the servers while generation goes on (each
completion reports the policies that produced it). With `deterministic` batch `step` is generated
with exactly policy max(0, step-1-max_async_level), seeded per request; see docs/architecture.md §1.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from hpcrl import checkpoint, runtime
from hpcrl.bus import Bus, BusTimeout, ShutdownRequested, TrainBatch
from hpcrl.config.schema import Config
from hpcrl.envs.errors import EnvServerFailed
from hpcrl.errors import UserError
from hpcrl.fileio import refused_write
from hpcrl.monitor import progress, watchdog
from hpcrl.monitor.logging import ENV_LEVEL_VAR, setup_logging
from hpcrl.monitor.metrics import Metrics
from hpcrl.monitor.wandb_sink import start_wandb_sink
from hpcrl.orchestrator import rollout_log, setup
from hpcrl.orchestrator.algo.mixed import component_scales, reference_advantages
from hpcrl.orchestrator.batch import (
    StepCounts,
    build_batches,
    fill_batch,
    fill_with_uniform,
    judge_group,
    num_rollouts,
    repack_batches,
    to_samples,
)
from hpcrl.orchestrator.causes import Causes, SystematicFailure
from hpcrl.orchestrator.eval import run_eval, run_val
from hpcrl.orchestrator.metrics import PromptsLog, sample_rows, step_metrics
from hpcrl.orchestrator.packing import PackStats
from hpcrl.orchestrator.policy import PolicyMismatch, PolicySync
from hpcrl.orchestrator.servers import InferenceUnavailable, ServerSet
from hpcrl.orchestrator.stalls import StallWatch
from hpcrl.orchestrator.state import GroupRecord, OrchestratorState, check_compatible, load_part, save_part
from hpcrl.orchestrator.writes import write_retrying
from hpcrl.paths import RunPaths

log = logging.getLogger("hpcrl.orchestrator")


MAX_WAVES = 64  # generation rounds for one batch before filtering is declared to drop everything
# After this many rounds, a batch that only zero-advantage dropping keeps from filling is filled with
# those groups (advantage 0: no gradient) instead of generating on: a policy that has mastered an
# easy environment must not stall or crash a run.
REFILL_WAVES = 16
STOP_GRACE_S = 30.0  # after a stop signal: how long to wait for the trainer's forced checkpoint


class Stopping(Exception):
    """SIGTERM / SIGUSR2 arrived: leave the loop at the next safe point."""


def main(cfg: Config) -> int:
    setup_logging("orchestrator", (cfg.orchestrator.log or cfg.log).level)
    os.environ[ENV_LEVEL_VAR] = (cfg.orchestrator.log or cfg.log).vf_level  # env servers it starts inherit it
    runtime.start_process(cfg, RunPaths(cfg.output_dir), "orchestrator", 0)
    # Beaten by answered requests, policy loads, published batches and waits on the trainer: a blocked
    # event loop or a wait that never ends stops all of them.
    watchdog.start("orchestrator", cfg.watchdog_s)
    paths = RunPaths(cfg.output_dir)
    progress.start("orchestrator", paths.progress_dir, paths.stalls_dir, cfg.stall_warning_s)
    try:
        return asyncio.run(Orchestrator(cfg).run())
    except ShutdownRequested as e:
        log.info("shutdown requested (%s): exiting", e)
        return 0
    except (
        PolicyMismatch,
        InferenceUnavailable,
        SystematicFailure,
        EnvServerFailed,
        BusTimeout,
        TimeoutError,
    ) as e:  # the run failed, not the code
        log.error("orchestrator failed: %s: %s", type(e).__name__, e)
        return 1
    except OSError as e:  # a write the filesystem refused (disk full, not writable): one line
        if (why := refused_write(e)) is None:
            raise
        log.info("the refused write", exc_info=True)
        log.error("orchestrator failed: %s", why)
        return 1


class Orchestrator:
    def __init__(self, cfg: Config):
        self.cfg, self.orch_cfg = cfg, cfg.orchestrator
        self.paths = RunPaths(cfg.output_dir)
        self.stop = asyncio.Event()
        self.unhurried = False  # the stop came by SIGUSR2 only: wait for the trainer's checkpoint
        self.published: dict[int, list[TrainBatch]] = {}  # batches the trainer may not have trained yet
        self.ckpt_done = 0  # newest policy step whose checkpoint question is settled
        # Built by run() (envs, buffer, generators, tokenizer: setup.build), then connect() (bus,
        # servers, weight sync, metrics) and restore() (state); None until then, so close() and
        # drain() know what exists after a failure part-way through.
        self.setup: setup.Setup | None = None
        self.bus: Bus | None = None
        self.servers: ServerSet | None = None
        self.sync: PolicySync | None = None
        self.metrics: Metrics | None = None
        self.wandb_sink: Any = None
        self.prompts: PromptsLog | None = None
        self.rollout_log: rollout_log.RolloutLog | None = None  # saved rollouts (issue 51)
        self.state: OrchestratorState | None = None
        self.start = 0  # the checkpoint step this run continues from (0: fresh)
        self.next_ready: list[GroupRecord] = []  # groups carried to the next batch, committed by publish()
        self.pack_stats: PackStats | None = None  # of the batch being published, for its metrics
        self.causes = Causes(self.orch_cfg.systematic_error_rollouts)  # why rollouts error, per env
        self.stalls: StallWatch | None = None

    async def run(self) -> int:
        progress.waiting("its own set-up (environments, env servers, tokenizer)")
        self.setup = setup.build(
            self.cfg, self.paths
        )  # fails in one line on a bad env id / args, before any work
        self.install_signals()
        try:
            self.sync = await self.connect()
            self.restore()
            self.rollout_log.forget_after(self.state.step, self.state.evaluated)  # regenerated: rewritten
            await self.load_start_policy()
            await self.maybe_eval()
            watchers = self.start_watchers()
            try:
                for step in range(self.state.step + 1, self.cfg.max_steps + 1):
                    t_policy = await self.guard(self.policy_for(step), watchers)
                    groups, generated, counts, t_gen = await self.guard(self.collect(step), watchers)
                    batches = await self.publish(step, groups, counts)
                    self.log_step(step, groups, generated, counts, batches, t_policy, t_gen)
                    await self.guard(self.at_boundary(step), watchers)
                await self.guard(self.finish(), watchers)
            finally:
                for w in watchers:
                    w.cancel()
        except Stopping:
            await self.drain()
        except ShutdownRequested:
            # A trainer that announces its stop has begun its last checkpoint: it needs our part.
            if self.sync is not None and self.state is not None:
                await self.checkpoints(forced=True)
            raise
        finally:
            await self.close()
        return 0

    # -- setup ------------------------------------------------------------------------------------
    def start_watchers(self) -> list[asyncio.Task]:
        """Background tasks whose failure ends the run: the reviver of dead servers, and (unless
        deterministic) the loader of every new policy."""
        tasks = [
            asyncio.create_task(self.sync.revive()),
            asyncio.create_task(self.stalls.run()),
            asyncio.create_task(self.setup.poller.run()),  # /metrics -> in-flight cap, inference/* gauges
        ]
        if not self.cfg.deterministic:
            tasks.append(asyncio.create_task(self.sync.watch()))
        return tasks

    def install_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGUSR2, signal.SIGINT):
            loop.add_signal_handler(sig, self.on_signal, sig)
        # `hpcrl run` starts this process with SIGUSR2 blocked (hpcrl.launch.local.spawn): one sent
        # during start-up was held for this handler.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR2})

    def on_signal(self, sig: int) -> None:
        log.warning("received signal %d: stopping at the next safe point", sig)
        if self.setup is not None and sig != signal.SIGUSR2:  # USR2's stop is unhurried: servers still serve
            self.setup.stopping()
        if sig != signal.SIGUSR2:  # SIGTERM/SIGINT: bounded, whatever the loop is waiting for
            from hpcrl.monitor.watchdog import arm_exit_deadline

            arm_exit_deadline("orchestrator")
            self.unhurried = False
        elif not self.stop.is_set():
            self.unhurried = True  # USR2 (time limit near, preemption, cancel --checkpoint): no deadline
        self.stop.set()

    async def connect(self) -> PolicySync:
        wanted, timeout = self.setup.num_servers, self.orch_cfg.policy_timeout_s
        progress.waiting(f"{wanted} inference server(s) to announce themselves ({self.paths.root / 'bus'})")
        self.bus = Bus(self.paths, role="orchestrator", timeout=timeout)
        servers = self.bus.wait_servers(wanted, timeout=timeout)[:wanted]
        log.info("inference servers: %s", ", ".join(x.base_url for x in servers))
        from hpcrl.inference.guard import resolve_api_key

        self.servers = ServerSet(self.paths, servers, self.orch_cfg.server_down_timeout_s)
        sync = PolicySync(
            self.paths,
            self.bus,
            [x.base_url for x in servers],
            self.setup.transport,
            self.orch_cfg.request_timeout_s,
            self.orch_cfg.policy_timeout_s,
            api_key=resolve_api_key(self.cfg.server.api_key),
            servers=self.servers,
        )
        await sync.wait_healthy()
        if self.setup.transport == "collective":
            await sync.join_group(servers)
        self.setup.attach_servers(self.servers, lambda: sync.loaded or 0, lambda: sync.adapter)
        await self.setup.poller.poll_once()  # adaptive: the starting cap before the first request
        self.stalls = StallWatch(
            self.paths,
            self.servers,
            self.setup.pools,
            min(10.0, self.cfg.stall_warning_s / 2),
            sync,
            envs=[*self.setup.envs.values(), *(e.env for e in self.setup.eval_envs)],
        )
        if (me := progress.current()) is not None:
            me.culprit, me.extra = self.stalls.culprit, self.stalls.extra
        self.metrics = Metrics.for_run(self.cfg, self.paths, "orchestrator")
        self.wandb_sink = start_wandb_sink(self.cfg, self.paths, "orchestrator")
        self.prompts = PromptsLog(self.paths)
        self.rollout_log = rollout_log.from_setup(self.cfg, self.paths, self.setup)
        return sync

    def restore(self) -> None:
        """Fresh state, or checkpoint N's: pending batches N+1..B are re-published bit for bit."""
        n = self.cfg.ckpt.resume_step if self.cfg.ckpt is not None else None
        if n is None or n == 0:
            self.state = self.setup.fresh_state()
            self.state.buffer = self.setup.buffer.state_dict()
            self.start = 0
            return
        state, pending = load_part(self.paths, n)
        check_compatible(state, self.orch_cfg.batch_size, self.orch_cfg.rollouts_per_example)
        self.setup.buffer.load_state_dict(state.buffer)
        self.setup.credit.load_state_dict(state.algo)  # rae's baselines
        for m, blobs in sorted(pending.items()):
            from hpcrl.bus import decode

            batches = [decode(b, TrainBatch) for b in blobs]
            if state.world_size != self.setup.world_size:
                # Packed for another number of trainer ranks: the same samples, re-packed (no prompt
                # skipped, repeated or regenerated; only the split over ranks changes).
                batches = repack_batches(batches, self.setup.world_size, self.cfg.seq_len)
            self.bus.publish_batches(m, batches)
            self.published[m] = batches
        if state.world_size != self.setup.world_size:
            log.warning(
                "checkpoint %d was taken with %d trainer rank(s), this run has %d: pending batches "
                "%s re-packed",
                n,
                state.world_size,
                self.setup.world_size,
                state.pending_steps,
            )
            state = msgspec.structs.replace(state, world_size=self.setup.world_size)
        self.state, self.start, self.ckpt_done = state, n, n
        self.prompts.truncate_after(state.step)
        log.info(
            "resumed from checkpoint %d: re-published batches %s, continuing at step %d",
            n,
            state.pending_steps,
            state.step + 1,
        )

    async def load_start_policy(self) -> None:
        """The trainer publishes PolicyReady(start) first; nothing is generated before every server
        holds exactly those weights."""
        msg = await self.wait(self.sync.exact(self.start))
        await self.sync.ensure(msg)
        await self.sync.verify(msg)

    # -- one step ---------------------------------------------------------------------------------
    async def policy_for(self, step: int) -> float:
        t0 = time.perf_counter()
        oldest_ok = max(0, step - 1 - self.orch_cfg.max_async_level)
        if self.cfg.deterministic:
            msg = await self.wait(self.sync.exact(oldest_ok))
        else:
            msg = await self.wait(self.sync.wait_at_least(oldest_ok))
        await self.sync.ensure(msg)
        return time.perf_counter() - t0

    async def collect(self, step: int) -> tuple[list[GroupRecord], list[GroupRecord], StepCounts, float]:
        """Groups for batch `step`: carried-over ones first, then new tasks (with oversampling) until
        the batch holds batch_size rollouts. Every drawn task ends generated, and is used, filtered
        or carried over, so the state at the next boundary is exact."""
        t0 = time.perf_counter()
        counts, generated = StepCounts(), []
        buffer = self.setup.buffer
        ready = list(self.state.ready)
        uniform: list[GroupRecord] = []  # dropped for zero advantage; the last-resort filler
        for wave in range(MAX_WAVES):
            missing = self.orch_cfg.batch_size - num_rollouts(ready)
            if missing <= 0:
                break
            if wave >= REFILL_WAVES and num_rollouts(uniform) >= missing:
                ready, counts.zero_advantage_filled = fill_with_uniform(ready, uniform, missing)
                log.warning(
                    "step %d: %d generation rounds kept returning groups with equal rewards; filled the "
                    "batch with %d of them (advantage 0: no gradient)",
                    step,
                    wave,
                    counts.zero_advantage_filled,
                )
                break
            refs = buffer.next_tasks(
                buffer.num_tasks_to_request(-(-missing // self.orch_cfg.rollouts_per_example))
            )
            progress.waiting(
                f"step {step}: rollouts of {sorted({r.env for r in refs})} (env servers, inference)"
            )
            new = await self.setup.generate(refs, step)
            progress.done()
            generated += new
            self.observe_errors(new)
            for ref, g in zip(refs, new):
                buffer.complete(ref)
                if judge_group(g, buffer, self.setup.credit, counts):
                    ready.append(g)
                elif g.advantages is not None:
                    uniform.append(g)
            if wave and wave % 8 == 0:
                log.warning(
                    "step %d: %d generation rounds and the batch is not full (filters: %s)",
                    step,
                    wave,
                    dict(counts.filtered),
                )
        else:
            raise UserError(
                f"step {step}: {MAX_WAVES} generation rounds did not fill a batch of "
                f"{self.orch_cfg.batch_size}; filters dropped {dict(counts.filtered)} (loosen the buffer/"
                "advantage filters or check the environment's rewards)"
            )
        # Committed with the batch in publish(): a stop before then leaves the last boundary intact.
        groups, self.next_ready = fill_batch(ready, self.orch_cfg.batch_size)
        if self.setup.reference is not None:  # opd / opsd: reference logprobs of every sequence
            await self.setup.reference.score(groups)
        return groups, generated, counts, time.perf_counter() - t0

    def observe_errors(self, groups: list[GroupRecord]) -> None:
        """Name each new cause of errored rollouts; end the run on a systematic one (causes.py)."""
        for g in groups:
            self.causes.observe(g.env, [r.error for r in g.rollouts])
        if any(r.errored for g in groups for r in g.rollouts):
            self.causes.write(self.paths.causes_file)
        self.causes.check()

    async def publish(self, step: int, groups: list[GroupRecord], counts: StepCounts) -> list[TrainBatch]:
        samples = to_samples(
            groups,
            step,
            self.orch_cfg.max_off_policy_steps,
            self.orch_cfg.train.sampling.temperature,
            self.setup.buffer,
            counts,
            images=self.setup.images,
        )
        kl_envs = self.setup.kl_as_advantage  # per-env opd / opsd in an rl run (algo.mixed)
        if kl_envs:
            samples = reference_advantages(samples, kl_envs)
        # Deterministic runs stamp batches with a fixed time so their bytes depend on the data only.
        batches, self.pack_stats = build_batches(
            samples,
            step,
            self.setup.world_size,
            self.cfg.seq_len,
            created_at=0.0 if self.cfg.deterministic else None,
        )
        if kl_envs:
            component_scales(batches, kl_envs)
        # The ranks' files concurrently (docs/bus.md); a refused write is named and retried (writes.py).
        await write_retrying(
            f"rollouts step {step}",  # the refusal names the path
            lambda: self.bus.publish_batches(step, batches),
            self.cfg.storage_timeout_s,
        )
        self.published[step] = batches
        # The boundary: everything a checkpoint saves is taken here, together. The live buffer runs
        # ahead during the next batch's generation; a forced (SIGTERM/preemption) checkpoint taken
        # mid-generation must not see cursors past tasks whose groups it does not hold.
        self.state.step = step
        self.state.ready = self.next_ready
        self.state.buffer = self.setup.buffer.state_dict()
        self.state.algo = self.setup.credit.state_dict()
        self.prompts.write(step, groups)
        return batches

    def log_step(
        self,
        step: int,
        groups: list[GroupRecord],
        generated: list[GroupRecord],
        counts: StepCounts,
        batches: list[TrainBatch],
        t_policy: float,
        t_gen: float,
    ) -> None:
        n_samples = sum(b.num_samples for b in batches)
        n_tokens = sum(b.num_tokens for b in batches)
        p = self.state.progress
        p["total_samples"] = p.get("total_samples", 0) + n_samples
        p["total_tokens"] = p.get("total_tokens", 0) + n_tokens
        p["total_problems"] = p.get("total_problems", 0) + len(groups)
        extra: dict[str, Any] = {
            **self.pack_stats.metrics(),
            **self.setup.buffer.metrics(),
            "policy/loaded": self.sync.loaded,
            "progress/total_samples": p["total_samples"],
            **self.server_metrics(),
            **self.setup.poller.metrics(),  # concurrency/*, inference/<server>/*
            **self.causes.metrics(),
            **self.stalls.metrics(),
        }
        m = step_metrics(groups, generated, step, counts, t_policy, t_gen, n_samples, n_tokens, extra)
        self.metrics.log(step, m)
        self.rollout_log.train(step, groups, generated, self.state.ready)  # a writer thread saves them
        watchdog.beat(f"published batch {step}")
        progress.step(step, f"published batch {step}")
        if self.metrics.samples_due(step):
            self.metrics.log_samples(step, sample_rows(groups, self.setup.tokenizer, step))
        if self.metrics.distributions_due(step):
            self.metrics.log_distribution(step, "reward", [r.reward for g in groups for r in g.rollouts])
            self.metrics.log_distribution(step, "advantage", [a for g in groups for a in g.advantages or []])
        log.info(
            "step %d: published %d samples (%d tokens), reward %.3f, policy %s, gen %.1fs",
            step,
            n_samples,
            n_tokens,
            m["reward/all/mean"],
            self.sync.loaded,
            t_gen,
        )

    def server_metrics(self) -> dict[str, int]:
        """Dead-server handling so far (cumulative): restarted servers brought back, requests moved
        off a dead server, servers up now."""
        moved = sum(p.moved for p in self.setup.pools)
        return {
            "inference/server_restarts": self.servers.restarts,
            "inference/requests_moved": moved,
            "inference/servers_up": len(self.servers.live()),
        }

    # -- boundaries -------------------------------------------------------------------------------
    async def at_boundary(self, step: int) -> None:
        if (stop := self.bus.poll_control()) is not None:
            raise ShutdownRequested(stop)
        await self.checkpoints(forced=False)
        await self.maybe_eval()
        v = self.orch_cfg.val
        if v is not None and v.interval and step % v.interval == 0:
            self.metrics.log(
                step,
                await run_val(
                    self.setup.eval_gen,
                    self.setup.envs,
                    v.num_examples,
                    v.rollouts_per_example,
                    self.setup.eval_sampling,
                    step,
                ),
            )

    async def checkpoints(self, forced: bool) -> None:
        """Write our part of every checkpoint the trainer takes: each due step N up to the newest
        policy, and (forced) any step whose trainer part appeared (SIGUSR2/SIGTERM checkpoints)."""
        c = self.cfg.ckpt
        newest = self.sync.observe()
        if c is None or c.weights_only:
            self.ckpt_done = max(self.ckpt_done, newest)
        else:
            for n in range(max(1, self.ckpt_done + 1), newest + 1):
                trainer_began = self.paths.trainer_ckpt_dir(n).is_dir()
                if checkpoint.is_due(n, self.cfg.max_steps, c.interval) or trainer_began:
                    await self.save(n)
                    self.ckpt_done = n
                elif not forced:
                    self.ckpt_done = max(self.ckpt_done, n - 2)  # a forced checkpoint shows up a little late
        for m in [m for m in self.published if m <= self.ckpt_done]:
            del self.published[m]

    async def save(self, n: int) -> None:
        from hpcrl.bus import encode

        pending = [m for m in sorted(self.published) if n < m <= self.state.step]
        assert pending == list(range(n + 1, self.state.step + 1)), (n, pending, self.state.step)
        st = msgspec.structs.replace(self.state, checkpoint_step=n, pending_steps=pending)
        blobs = {m: [encode(b, checksum=self.bus.checksum) for b in self.published[m]] for m in pending}
        # a refused write: named, retried, one line past the bound; the waits do not block the event
        # loop (rollouts in flight, the watchers and the stall report go on meanwhile)
        await write_retrying(
            f"checkpoint step {n} (orchestrator part)", lambda: save_part(self.paths, st, blobs),
            self.cfg.storage_timeout_s, path=self.paths.orchestrator_ckpt_dir(n),
        )  # fmt: skip
        log.info(
            "checkpoint %d: orchestrator part written (state at batch %d, pending %s)",
            n,
            self.state.step,
            pending,
        )

    async def maybe_eval(self) -> None:
        e, k = self.orch_cfg.eval, self.sync.loaded
        if e is None or not e.interval or not self.setup.eval_envs or k is None or k in self.state.evaluated:
            return
        if k % e.interval == 0 and (k > 0 or e.eval_base_model) or k == self.cfg.max_steps:
            self.state.evaluated.append(k)
            saved: list = []
            self.metrics.log(
                k,
                await run_eval(self.setup.eval_gen, self.setup.eval_envs, self.setup.eval_sampling, k, saved),
            )
            self.rollout_log.eval(k, saved)

    async def finish(self) -> None:
        msg = await self.wait(self.sync.exact(self.cfg.max_steps))
        # Always load (and verify) the final policy: servers end on the trained weights, and with the
        # collective transport the trainer's last broadcast needs the servers on the receiving end.
        await self.sync.ensure(msg)
        await self.checkpoints(forced=False)
        if self.orch_cfg.eval is not None and self.setup.eval_envs:
            await self.maybe_eval()
        log.info("done: %d steps published", self.cfg.max_steps)
        self.metrics.log_finished(self.cfg.max_steps)  # a W&B sink in the trainer waits for this
        self.wandb_sink.close(wait_for_step=self.cfg.max_steps)

    async def drain(self) -> None:
        """After a stop signal: wait for the trainer's forced checkpoint and write our part for it (the
        state at the last boundary is consistent), then exit. After SIGTERM that wait is short (every
        role exits within seconds); after SIGUSR2 it lasts as long as the trainer's step and save may
        (policy_timeout_s; SLURM's checkpoint grace bounds the job). A Shutdown on the bus (the launcher
        once the trainer has exited) ends it at once: nothing more is coming."""
        grace = self.orch_cfg.policy_timeout_s if self.unhurried else STOP_GRACE_S
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.sync is not None:
            before = self.ckpt_done
            await self.checkpoints(forced=True)
            if self.ckpt_done > before or (self.bus is not None and self.bus.poll_control() is not None):
                break
            await asyncio.sleep(0.5)
        log.warning("stopped at a batch boundary (last published step %s)", self.state and self.state.step)

    async def close(self) -> None:
        for part in (self.sync, self.setup):
            if part is not None:
                await part.aclose()
        for part in (self.rollout_log, self.prompts, self.metrics, self.wandb_sink, self.bus):
            if part is not None:
                part.close()

    # -- helpers ----------------------------------------------------------------------------------
    async def wait(self, coro: Any) -> Any:
        return await self.guard(coro, ())

    async def guard(self, coro: Any, watchers: Sequence[asyncio.Task]) -> Any:
        """Run `coro` unless a stop signal comes first (Stopping) or a background task dies (its
        error: PolicyMismatch from the policy watcher, InferenceUnavailable from the reviver)."""
        task = asyncio.ensure_future(coro)
        stop = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({task, stop, *watchers}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if task.done():
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for w in watchers:
            if w.done():
                w.result()  # raises the task's error
        raise Stopping()
