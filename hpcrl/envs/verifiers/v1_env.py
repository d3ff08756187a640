"""verifiers 0.4 (v1) environments, run unchanged through verifiers' own env server and client.

This process loads the env's Taskset (its tasks become hpcrl Tasks carrying the dumped TaskData) and
spawns `verifiers.v1.serve.serve_env`: an EnvServer, or an EnvServerPool broker over `workers`
worker processes, which runs the episodes: env, harness and runtime code never run here. Each
rollout is `EnvClient.run(TrainClientConfig, model, sampling, task_data)`; verifiers' TrainClient
renders with `renderers` and calls hpcrl's `/inference/v1/generate`. The returned WireEpisode's
trained traces become training samples: each branch's `token_ids` / `sampled_mask` / `logprobs` is
cut into turns at its sampled spans, so hpcrl's stitching rebuilds exactly that sequence and mask
(one sample per trained branch of every trained trace).

Policy versions: the generate route reports `policy_steps`, but verifiers' client does not carry it
into the trace. We do what verifiers' PolicySpan records: the live policy when the episode is
dispatched (the step every server had loaded) is its `start`; servers only move forward, so every
token of the episode came from that policy or a newer one. Tokens are tagged with it, so
max_off_policy_steps judges an episode by its dispatch step (strict, never too lenient).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import multiprocessing as mp
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpcrl.envs.base import ChatClient, Environment, Task, Trajectory, Turn, normalize_split
from hpcrl.envs.errors import EnvServerFailed
from hpcrl.envs.verifiers.v1_runtime import effective

log = logging.getLogger("hpcrl.envs")
_DATA = "_vf_task_data"
START_TIMEOUT_S = 300.0


def _log_to(path: str) -> None:
    """log_setup for serve_env (module level: spawned processes unpickle it)."""
    from hpcrl.storage import TolerantFileHandler

    handler = TolerantFileHandler(path)  # a log the disk refuses never ends the env
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    from hpcrl.monitor.logging import env_process_level

    root.setLevel(env_process_level())


def env_config(
    env_id: str, args: Mapping[str, Any], runtime: str | None, table: Mapping[str, Any] | None = None
) -> tuple[Any, list[str]]:
    """verifiers' EnvConfig for a taskset module with `args` as taskset fields, every seat in
    `runtime` (see hpcrl.envs.verifiers.v1_runtime.effective), plus the notes to log. `table`:
    verifiers' own env config (prime-rl's source.env: taskset, agent harness / runtime / timeout,
    seats), the base the rest applies to."""
    import copy

    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import resolve_env_config

    data: dict[str, Any] = copy.deepcopy(dict(table or {}))
    taskset = data.get("taskset") if isinstance(data.get("taskset"), dict) else {}
    data["taskset"] = {**taskset, "id": taskset.get("id", env_id), **dict(args)}
    try:
        seats = agent_config_fields(resolve_env_config(data))
        notes = []
        for role, agent in seats.items():
            chosen, note = effective(runtime, agent.runtime.type)
            seat = data.get(role) if isinstance(data.get(role), dict) else {}
            data[role] = {**seat, "runtime": {**(seat.get("runtime") or {}), "type": chosen}}
            if note:
                notes.append(f"env {env_id!r} seat {role!r} {note}")
        return resolve_env_config(data), notes
    except Exception as e:  # pydantic ValidationError: an unknown taskset field, a bad value
        raise ValueError(f"environment {env_id!r}: {' '.join(str(e).split())[:400]}") from None


def branch_routes(nodes: Sequence[Any]) -> Any:
    """A branch's MoE routing ``[tokens, layers, k]`` (int16, -1 where a node has none), or None when
    no node has any. verifiers' own ``Branch.routed_experts`` is None unless every node has rows."""
    import numpy as np

    widths = [n.routed_experts.shape[1:] for n in nodes if n.token_ids and n.routed_experts is not None]
    if not widths:
        return None
    parts = []
    for n in nodes:
        r = n.routed_experts
        ok = r is not None and r.shape[0] == len(n.token_ids) and r.shape[1:] == widths[0]
        parts.append(r.astype(np.int16) if ok else np.full((len(n.token_ids), *widths[0]), -1, np.int16))
    return np.concatenate(parts)


def branch_turns(
    ids: Sequence[int],
    mask: Sequence[bool],
    logprobs: Sequence[float],
    policy: int,
    routes: Any = None,
) -> list[Turn]:
    """A branch as turns: one per run of sampled tokens, its prompt everything before the run, so
    stitch_turns gives back `ids` (up to the last sampled token) with `mask` as the loss mask.
    ``routes`` ([len(ids), layers, k] or None, see branch_routes): each turn carries its prompt's
    and its sampled tokens' rows."""
    turns, i, n = [], 0, len(ids)
    while i < n:
        if not mask[i]:
            i += 1
            continue
        j = i
        while j < n and mask[j]:
            j += 1
        turns.append(
            Turn(
                text="",
                prompt_token_ids=list(ids[:i]),
                completion_token_ids=list(ids[i:j]),
                completion_logprobs=[float(x) for x in logprobs[i:j]],
                policy_steps=[policy] * (j - i),
                routed_experts=None if routes is None else routes[i:j].tolist(),
                prompt_routed_experts=None if routes is None else routes[:i].tolist(),
            )
        )
        i = j
    return turns


def episode_trajectory(task: Task, episode: Any, policy: int) -> Trajectory:
    """A WireEpisode -> one Trajectory whose turns cover every trained branch of every trained
    trace (the record's pieces: one sample each). reward = mean reward of the trained traces (what
    the metrics and the difficulty filter see); with several trained traces (multi-agent) each
    turn carries its trace's index and `trace_rewards` its own reward, so every trace is scored as
    itself against the same trace of the group's other rollouts."""
    traces = [t for t in episode.traces if t.agent.trainable]
    turns: list[Turn] = []
    metrics: dict[str, float] = {}
    weights: dict[str, float] = {}
    truncated = False
    for j, trace in enumerate(traces):
        for branch in trace.branches:
            if branch.trainable:
                more = branch_turns(
                    branch.token_ids,
                    branch.sampled_mask,
                    branch.logprobs,
                    policy,
                    branch_routes(branch.nodes),
                )
                if turns and more:  # a forked branch (the renderer could not bridge): its own sample
                    more[0].rerendered = True
                for t in more:
                    t.trace = j
                turns += more
            truncated |= any(c.finish_reason == "length" for c in branch.calls)
        for k, v in trace.metrics.items():
            if v is not None:
                metrics[k] = metrics.get(k, 0.0) + float(v) / len(traces)
        for k, r in trace.rewards.items():
            if r is not None:
                metrics[k] = metrics.get(k, 0.0) + float(r.score) / len(traces)
                weights.setdefault(k, float(r.weight))
    # A failed model call first: it is the cause (verifiers' interception answers the harness 502 and
    # logs it; the harness then fails as a consequence, e.g. `HarnessError: ... exited 1: Traceback`).
    calls = [c.error for t in episode.traces for c in t.calls if c.error is not None]
    errors = [*calls, *episode.errors, *(e for t in traces for e in t.errors)]
    said = list(dict.fromkeys(f"{e.type}: {e.message}" for e in errors))
    error = None if episode.ok and not errors else "; ".join(said)[:500]
    if error is None and not traces:
        error = "the episode has no trained trace"
    metrics["num_traces"] = float(len(traces))
    last = traces[-1].branches[-1].messages if traces and traces[-1].branches else []
    messages = [m.model_dump(mode="json", exclude_none=True) for m in last]  # for eval's results
    num_prompt = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    return Trajectory(
        task=task,
        messages=messages,
        num_prompt_messages=num_prompt,
        turns=turns,
        reward=sum(t.reward for t in traces) / len(traces) if traces else 0.0,
        metrics=metrics,
        truncated=truncated,
        error=error or None,
        trace_rewards=[float(t.reward) for t in traces] if len(traces) > 1 else None,
        reward_weights=weights,
    )


def v1_sampling(sampling: Mapping[str, Any], seed: int | None = None) -> Any:
    """The orchestrator's request fields as verifiers' SamplingConfig. Keys it does not name (top_k,
    min_p, repetition_penalty, the rollout's seed) pass through to /inference/v1/generate's
    sampling_params (extra="allow"); chat_template_kwargs goes to the renderer."""
    from verifiers.v1.types import SamplingConfig

    fields = {k: v for k, v in sampling.items() if v is not None}
    if seed is not None:
        fields["seed"] = seed
    return SamplingConfig.model_validate(fields)


class V1Environment(Environment):
    """hpcrl's Environment over a verifiers v1 env served by verifiers' own env server."""

    def __init__(
        self,
        env_id: str,
        args: Mapping[str, Any],
        *,
        runtime: str | None = None,
        table: Mapping[str, Any] | None = None,
        workers: int = 1,
        rollout_timeout_s: float = 600.0,
        max_restarts: int = 3,
    ) -> None:
        super().__init__()
        from verifiers.v1.utils.loaders import load_taskset

        self.env_id, self.workers = env_id, max(1, workers)
        self.rollout_timeout_s, self.max_restarts, self.restarts = rollout_timeout_s, max_restarts, 0
        self.stopping = False  # the orchestrator is stopping (Setup.stopping): a server that ends is let go
        self.log_dir: Path | None = None
        self.name = env_id
        self.config, self.notes = env_config(env_id, args, runtime, table)
        for note in self.notes:
            log.warning(note)
        self.max_turns = 1
        self._tasks = [
            Task(
                example_id=int(t.data.idx),
                prompt=[{"role": "user", "content": t.data.prompt if isinstance(t.data.prompt, str) else ""}],
                info={_DATA: t.data.model_dump(mode="json")},
            )
            for t in load_taskset(self.config.taskset)
        ]
        self.proc: Any = None
        self._stop: Any = None  # the server's finalizer (hpcrl.envs.verifiers.v1_serve.stop_server)
        self._worker_pids: list[int] = []
        self.address: str | None = None
        self._client: Any = None
        self._loop: Any = None

    @property
    def group_scored(self) -> bool:
        return True

    def tasks(self, split: str = "train", seed: int | None = None) -> Sequence[Task]:
        normalize_split(split)  # a v1 taskset has one set of tasks: every split reads it
        return self._tasks

    def start(self, log_dir: Path | None = None) -> None:
        """Spawn verifiers' serve_env (hpcrl.envs.verifiers.v1_serve.serve) and wait for its address: a server
        that exits while starting, or is not up in START_TIMEOUT_S, is a one-line ValueError."""
        import queue as queue_mod
        import time
        from multiprocessing import util as mp_util

        from verifiers.v1.serve import env_config_data

        from hpcrl.envs.verifiers import v1_serve

        self.log_dir = log_dir
        ctx = mp.get_context("spawn")
        queue, (parent, child) = ctx.Queue(), ctx.Pipe()
        log_setup = None
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            log_setup = functools.partial(_log_to, str(log_dir / "server.log"))
        self.proc = ctx.Process(
            target=v1_serve.serve,
            kwargs=dict(
                parent=os.getpid(),
                max_workers=self.workers,
                address="tcp://127.0.0.1:0",
                address_queue=queue,
                death_pipe=child,
                log_setup=log_setup,
                elastic=False,
                config_data=env_config_data(self.config),
            ),
            daemon=False,
        )
        self.proc.start()
        child.close()
        # Our end of the death pipe (closing it, or our death, stops the server) and the server are
        # stopped by close_now, by garbage collection of this object, and at exit before
        # multiprocessing joins its children (see hpcrl.envs.verifiers.v1_serve: that join deadlocked).
        self._stop = mp_util.Finalize(self, v1_serve.stop_server, args=(self.proc, parent), exitpriority=10)
        self._worker_pids = []
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                self.address = queue.get(timeout=0.5)
                break
            except queue_mod.Empty:
                code = self.proc.exitcode
                if code is None and time.monotonic() < deadline:
                    continue
                self.close_now()
                why = (
                    f"exited with code {code}" if code is not None else f"was not up in {START_TIMEOUT_S:g} s"
                )
                where = f"; see {log_dir / 'server.log'}" if log_dir is not None else ""
                raise ValueError(f"environment {self.env_id!r}: verifiers' env server {why}{where}") from None
        if log_dir is not None:  # which process serves the env (hpcrl components, fault tests)
            from hpcrl.fileio import write_text

            write_text(log_dir / "server.pid", f"{self.proc.pid}\n", durable=False)
            self._write_components(log_dir)

    def _write_components(self, log_dir: Path) -> None:
        """components.json as hpcrl's own env servers write it (hpcrl components / status); the pool's
        workers are the server's spawned children (verifiers does not report them)."""
        import json

        from hpcrl.envs.runtime.components import _node
        from hpcrl.fileio import write_text

        pid = self.proc.pid
        doc = {
            "env": log_dir.name,
            "kind": log_dir.parent.name,
            "server": {"pid": pid, "node": _node(), "restarts": self.restarts, "impl": "verifiers.v1.serve"},
            "workers": [
                {"index": i, "pid": c, "node": _node(), "restarts": 0}
                for i, c in enumerate(self._learn_workers())
            ],
        }
        write_text(log_dir / "components.json", json.dumps(doc), durable=False)

    def _learn_workers(self) -> list[int]:
        """The pool's worker pids (spawned by the broker after it reports its address: learnt as they
        appear, kept once all are known); none for a lone server (workers = 1)."""
        if self.workers > 1 and len(self._worker_pids) < self.workers and self.proc is not None:
            from hpcrl.envs.verifiers.v1_serve import worker_pids

            self._worker_pids = worker_pids(self.proc.pid)[: self.workers]
        return self._worker_pids

    def _lost_worker(self) -> int | None:
        """A worker of the pool that has exited (verifiers' pool never replaces one and keeps sending it
        requests, which then wait forever), else None."""
        from hpcrl.envs.verifiers.v1_serve import exited

        known = len(self._worker_pids)
        pids = self._learn_workers()
        if len(pids) > known and self.log_dir is not None:
            self._write_components(self.log_dir)
        return next((p for p in pids if exited(p)), None)

    def _env_client(self) -> Any:
        from verifiers.v1.serve import EnvClient

        loop = asyncio.get_running_loop()
        if self._client is None or self._loop is not loop:
            if self.proc is None:
                self.start(self.log_dir)
            self._client, self._loop = EnvClient(self.address), loop
            if self.log_dir is not None:  # the pool has spawned its workers by now: list them
                self._write_components(self.log_dir)
        return self._client

    async def rollout_group(
        self, task: Task, client: ChatClient, sampling: Mapping[str, Any], n: int
    ) -> list[Trajectory]:
        from verifiers.v1.configs.client import TrainClientConfig

        from hpcrl.net import API_KEY_ENV

        convs = [client.make(i) for i in range(n)]  # type: ignore[attr-defined]  (a GroupClient)
        env_client = self._env_client()

        async def one(c: Any) -> Trajectory:
            renderers = getattr(c, "renderers", None)
            tokenizer = renderers.tokenizer if renderers is not None else c.tokenizer
            train = TrainClientConfig(
                base_url=c.pool.base_urls[c.server].rstrip("/") + "/v1",
                api_key_var=API_KEY_ENV,  # the run's key: the server inherited it from this process
                renderer=renderers.config if renderers is not None else None,
                renderer_model_name=str(tokenizer.name_or_path),
            )
            policy = int(c.default_policy())  # the live policy at dispatch (PolicySpan.start)
            run = env_client.run(train, c.pool.model, v1_sampling(sampling, c.seed), dict(task.info[_DATA]))
            return episode_trajectory(task, await self._guarded(run), policy)

        runs = [asyncio.ensure_future(one(c)) for c in convs]
        try:
            return list(await asyncio.gather(*runs))
        finally:  # one failure errors the group: stop its other rollouts (verifiers' cancel reaches the server)
            for r in runs:
                r.cancel()

    async def _guarded(self, run: Any) -> Any:
        """`run` (an EnvClient.run), errored when it passes rollout_timeout_s (verifiers runs rollouts
        untimed; cancelling sends the server its cancel) or when the server process dies: then the
        server is started again, up to max_restarts times, after which the run ends (EnvServerFailed)."""
        loop, proc = asyncio.get_running_loop(), self.proc
        task = asyncio.ensure_future(run)
        deadline = loop.time() + self.rollout_timeout_s
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=1.0)
                if done:
                    return task.result()
                if proc is not None and not proc.is_alive():
                    if self.stopping:  # ended with the orchestrator's stop (Setup.stopping): let it go
                        raise RuntimeError(
                            f"verifiers' env server of {self.env_id!r} ended while the orchestrator stops"
                        )
                    self._server_died(proc, f"died (exit code {proc.exitcode})")
                    raise RuntimeError(
                        f"verifiers' env server of {self.env_id!r} died (exit code {proc.exitcode})"
                    )
                lost = self._lost_worker() if proc is self.proc else None
                if lost is not None and self.stopping:  # SLURM's SIGTERM reached a worker first
                    raise RuntimeError(
                        f"a worker (pid {lost}) of verifiers' env server of {self.env_id!r} ended while "
                        "the orchestrator stops"
                    )
                if lost is not None:
                    self._server_died(proc, f"lost its worker {lost}")
                    raise RuntimeError(
                        f"a worker (pid {lost}) of verifiers' env server of {self.env_id!r} died"
                    )
                if loop.time() > deadline:
                    raise TimeoutError(f"the episode ran past rollout_timeout_s = {self.rollout_timeout_s:g}")
        finally:
            if not task.done():
                task.cancel()

    def _server_died(self, proc: Any, what: str) -> None:
        if proc is not self.proc:  # another rollout already restarted it
            return
        self.restarts += 1
        if self.restarts > self.max_restarts:
            self.close_now()
            raise EnvServerFailed(
                f"verifiers' env server of {self.env_id!r} {what}; restarted "
                f"{self.restarts - 1} time(s), the limit (orchestrator.env_server_max_restarts) is reached"
            )
        log.warning("verifiers' env server of %r %s: starting it again", self.env_id, what)
        self.close_now()
        self.start(self.log_dir)

    async def rollout(self, task: Task, client: ChatClient, sampling: Mapping[str, Any]) -> Trajectory:
        raise NotImplementedError("a v1 env runs groups (rollout_group)")

    async def aclose(self) -> None:
        """The orchestrator's shutdown (Setup.aclose): the server must not outlive the run."""
        self.close_now()

    def close_now(self) -> None:
        if self._client is not None:
            try:
                if self._client._receiver is not None:
                    self._client._receiver.cancel()
                self._client.socket.close(linger=0)
                self._client.ctx.term()
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
            self._client = None
        if self._stop is not None:
            self._stop()  # hpcrl.envs.verifiers.v1_serve.stop_server, once
            self._stop = None
        self.proc = None
        self._worker_pids = []
