"""Everything the orchestrator builds before its loop: tokenizer, environments, buffer, generators.

`build` runs before any process is contacted, so an unknown environment id or a bad argument is a
one-line ValueError before any work.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from hpcrl.config.schema import Config, EnvConfig, OrchestratorConfig, SamplingConfig
from hpcrl.envs import Environment, Task, load_environment
from hpcrl.envs.registry import alias_note, v1_module
from hpcrl.errors import ConfigError
from hpcrl.orchestrator.algo import Credit, References, ReferenceScorer
from hpcrl.orchestrator.buffer import Buffer, BufferConfig, TaskRef
from hpcrl.orchestrator.chat import openai_sampling
from hpcrl.orchestrator.eval import EvalEnv
from hpcrl.orchestrator.pool import ServerPool
from hpcrl.orchestrator.rollout import Generator
from hpcrl.orchestrator.servers import ServerSet
from hpcrl.orchestrator.state import GroupRecord, OrchestratorState
from hpcrl.paths import RunPaths

log = logging.getLogger("hpcrl.orchestrator")
# An env worker stopped, or an env server unanswering, for this many times stall_warning_s is killed
# and replaced like a crashed one (named as a stall at 1x; the rollout timeout is 600 s by default).
FROZEN_FACTOR = 2.0


def env_name(e: EnvConfig) -> str:
    return e.name or e.id.rsplit("/", 1)[-1]


def load_envs(
    envs: Sequence[EnvConfig],
    where: str,
    *,
    kind: str = "train",
    server_dir: Callable[[str, str], Path] | None = None,
    run_dir: str = "",
    default_workers: int = 1,
    max_restarts: int = 3,
    env_nodes: int = 0,
    first: int = 0,
    frozen_s: float = 0.0,
) -> dict[str, Environment]:
    """Every env of a list, each in its own env server (`server_dir(kind, name)` holds its logs) with
    `workers` (or `default_workers`) worker processes; in this process when workers = 0 or no
    `server_dir` is given (data-only uses such as SFT task lists). `env_nodes` > 0: the servers run
    on the SLURM job's env nodes (env `first + i` on node `(first + i) % env_nodes`), ordered
    through the run directory (hpcrl.envs.runtime.hosting) instead of started here. `frozen_s` > 0:
    a worker stopped that long, or a server that answers no ping that long, is killed and replaced
    like a crashed one (ServerSpec.frozen_s)."""
    out: dict[str, Environment] = {}
    starting: list[tuple[int, Any]] = []
    try:
        for i, e in enumerate(envs):
            name = env_name(e)  # the configured name: metrics, logs/envs/<kind>/<name>.log
            workers = e.workers if e.workers is not None else default_workers
            v1 = v1_module(e.id)
            if e.env and v1 is None:
                raise ConfigError(
                    f"{where}[{i}].env",
                    f"env {e.id!r} is not a verifiers 0.4 (v1) taskset; only those take a verifiers env table",
                )
            if e.runtime is not None and v1 is None:
                raise ConfigError(
                    f"{where}[{i}].runtime",
                    f"env {e.id!r} is not a verifiers 0.4 (v1) environment; only those run in a runtime",
                )
            try:
                if (
                    v1 is not None
                ):  # verifiers' own env server runs its episodes (hpcrl.envs.verifiers.v1_env)
                    from hpcrl.envs.verifiers.v1_env import V1Environment

                    env = V1Environment(
                        v1,
                        e.args,
                        runtime=e.runtime,
                        table=e.env,
                        workers=workers,
                        rollout_timeout_s=e.rollout_timeout_s,
                        max_restarts=max_restarts,
                    )
                    env.start(server_dir(kind, name) if server_dir is not None else None)
                elif server_dir is None or workers == 0:
                    env = load_environment(e.id, **e.args)
                    note = alias_note(e.id)
                    if note:
                        log.warning(note)
                else:
                    from hpcrl.orchestrator.remote_env import RemoteEnvironment, server_spec

                    where_logs = server_dir(kind, name)
                    spec = server_spec(
                        e.id,
                        e.args,
                        name,
                        kind,
                        workers,
                        e.rollout_timeout_s,
                        where_logs,
                        run_dir,
                        i,
                        frozen_s,
                    )
                    env = RemoteEnvironment(
                        spec, max_restarts, wait=False, **hosted(run_dir, kind, name, first + i, env_nodes)
                    )
                    starting.append((i, env))
            except ValueError as err:  # bad environment arguments (ConfigError included): name the entry
                raise ConfigError(f"{where}[{i}]", str(err)) from None
            env.name = name
            out[env.name] = env
        for i, env in starting:  # every server loads its env at once; wait for each in turn
            try:
                env.wait_ready()
            except ValueError as err:
                raise ConfigError(f"{where}[{i}]", str(err)) from None
    except BaseException:
        close_envs(out.values())
        raise
    return out


def hosted(run_dir: str, kind: str, name: str, index: int, env_nodes: int) -> dict[str, Any]:
    """RemoteEnvironment's `server` / `bind_host` for an env server on env node `index % env_nodes`
    (none: the orchestrator's own child on 127.0.0.1)."""
    if env_nodes <= 0:
        return {}
    from hpcrl.bus.doorbell import resolve_host
    from hpcrl.envs.runtime.hosting import HostedServer

    paths = RunPaths(run_dir)
    server = HostedServer(paths.env_spec_file(kind, name), paths.env_exit_file(kind, name), index % env_nodes)
    return {"server": server, "bind_host": resolve_host(os.environ.get("HPCRL_BUS_HOST") or "auto")}


def close_envs(envs: Any) -> None:
    """Stop the env servers among `envs` (in-process envs need nothing)."""
    for env in envs:
        close = getattr(env, "close_now", None)
        if close is not None:
            close()


def deployment(cfg: Config) -> tuple[int, int, str]:
    """(trainer ranks, inference servers, weight transport) as the launcher laid the run out: the
    launcher records them in the resolved config (hpcrl.launch.prepare.apply_placement), so every role
    reads the same values wherever it runs."""
    d = cfg.deployment
    from hpcrl.runtime import weight_transport

    return d.num_trainer_ranks or 1, d.num_inference_servers or 1, weight_transport(cfg)


@dataclass
class Setup:
    cfg: Config
    tokenizer: Any
    envs: dict[str, Environment]
    tasks: dict[str, Sequence[Task]]
    buffer: Buffer
    credit: Credit  # the algorithm's credit assignment (orchestrator.algo)
    world_size: int
    num_servers: int
    transport: str
    eval_envs: list[EvalEnv]
    train_sampling: dict[str, Any]
    eval_sampling: dict[str, Any]
    renderers: Any = None  # hpcrl.orchestrator.renderer_client.Renderers, or None for the default renderer
    pools: list[ServerPool] = field(default_factory=list)
    teacher: ServerPool | None = None  # the algorithm's frozen model (opd's teacher, sft's source)
    reference: ReferenceScorer | References | None = None  # opd / opsd: reference logprobs of each batch
    # Envs whose reference logprobs become advantages: opd / opsd envs in an rl run (algo.mixed).
    kl_as_advantage: frozenset[str] = frozenset()
    train_gen: Generator | None = None
    eval_gen: Generator | None = None
    poller: Any = None  # hpcrl.orchestrator.concurrency.poller.Poller of the student servers
    images: Any = None  # [model.vlm]: hpcrl.orchestrator.images.SampleImages (image tensors of samples)

    def fresh_state(self) -> OrchestratorState:
        o = self.cfg.orchestrator
        return OrchestratorState(
            step=0,
            checkpoint_step=0,
            world_size=self.world_size,
            batch_size=o.batch_size,
            rollouts_per_example=o.rollouts_per_example,
            buffer={},
            ready=[],
            progress={},
            evaluated=[],
            pending_steps=[],
        )

    def attach_servers(
        self,
        servers: ServerSet,
        loaded_policy: Callable[[], int],
        adapter: Callable[[], str | None] = lambda: None,
    ) -> None:
        """Generators over the student servers (and the algorithm's frozen model: opd's teacher, sft's
        sampling source), the reference scorer of opd / opsd; `adapter` names the LoRA adapter the
        students serve the loaded policy under (None: their base name)."""
        cfg, o = self.cfg, self.cfg.orchestrator
        # Deterministic mode seeds every request; otherwise the servers draw their own randomness.
        seed = None
        if cfg.deterministic:
            seed = o.train.sampling.seed if o.train.sampling.seed is not None else cfg.seed
        from hpcrl.inference.guard import resolve_api_key

        conc = o.concurrency
        ceiling = (conc.max_inflight or o.max_concurrent) if conc.mode == "adaptive" else o.max_concurrent
        student = ServerPool(
            [s.base_url for s in servers.infos],
            model=servers.infos[0].model,
            timeout=o.request_timeout_s,
            max_concurrent=ceiling,
            api_key=resolve_api_key(cfg.server.api_key),
            servers=servers,
        )
        student.adapter = adapter
        self.pools.append(student)
        self.poller = build_poller(cfg, student, ceiling)
        # Same strategy for eval and training, each with its own one-example-at-a-time lock under
        # branching, so eval never waits behind training groups.
        self.eval_gen = Generator(
            student, self.tokenizer, cfg.seq_len, loaded_policy, seed, o.trajectory_strategy, self.renderers
        )
        self.train_gen = Generator(
            student, self.tokenizer, cfg.seq_len, loaded_policy, seed, o.trajectory_strategy, self.renderers
        )
        # the message role of each env-provided token: only echo trains on them (a run without it
        # neither tokenizes with offsets nor keeps a byte per token)
        self.eval_gen.images = self.train_gen.images = self.images  # [model.vlm]: image prompt lengths
        self.train_gen.env_roles = "echo" in {o.algo.type, *(e.algo.type for e in o.train.env if e.algo)}
        frozen = o.algo.frozen
        if frozen is not None:
            self.teacher = ServerPool(
                [frozen.base_url],
                model=frozen.name,
                timeout=o.request_timeout_s,
                max_concurrent=o.max_concurrent,
                api_key=os.environ.get(frozen.api_key_var),
            )
            self.pools.append(self.teacher)
            if o.algo.type == "opd":
                self.reference = ReferenceScorer(self.teacher)
            if o.algo.action_loss == "ce":  # the frozen model writes the completions; never stale
                self.train_gen = Generator(
                    self.teacher,
                    self.tokenizer,
                    cfg.seq_len,
                    lambda: max(0, loaded_policy()),
                    seed,
                    o.trajectory_strategy,
                )
        if o.algo.type == "opsd":  # the live policy, shown the task's demonstration
            self.reference = ReferenceScorer(
                student,
                hint=self.opsd_hint(),
                template=o.algo.template,
                demo_key=o.algo.demo_key,
                task_of=lambda g: self.tasks[g.env][g.task_index],
            )
        self.attach_env_algos(student)
        log.info("algorithm %s: %s", o.algo.type, algo_summary(o.algo))

    def attach_env_algos(self, student: ServerPool) -> None:
        """Per-env algorithms (prime-rl's per-source algo): each opd / opsd env's reference scorer
        (its own teacher, or the policy shown its demonstration); in a run mixing them with rl envs,
        their signal goes into advantages (hpcrl.orchestrator.algo.mixed)."""
        o = self.cfg.orchestrator
        per_env: dict[str, ReferenceScorer | None] = {}
        for i, e in enumerate(o.train.env):
            algo = e.algo
            if algo is None:
                continue
            name = env_name(e)
            if algo.type == "opd":
                assert algo.teacher is not None
                pool = ServerPool(
                    [algo.teacher.base_url],
                    model=algo.teacher.name,
                    timeout=o.request_timeout_s,
                    max_concurrent=o.max_concurrent,
                    api_key=os.environ.get(algo.teacher.api_key_var),
                )
                self.pools.append(pool)
                per_env[name] = ReferenceScorer(pool)
            elif algo.type == "opsd":
                per_env[name] = ReferenceScorer(
                    student,
                    hint=self.opsd_hint(algo, f"orchestrator.train.env[{i}].algo"),
                    template=algo.template,
                    demo_key=algo.demo_key,
                    task_of=lambda g: self.tasks[g.env][g.task_index],
                )
            else:
                per_env[name] = None  # an rl type: no reference
            log.info("env %s: algorithm %s: %s", name, algo.type, algo_summary(algo))
        if per_env:
            self.reference = References(self.reference, per_env)
        if o.algo.action_loss == "rl":
            self.kl_as_advantage = frozenset(n for n, sc in per_env.items() if sc is not None)

    def opsd_hint(self, algo: Any = None, where: str = "orchestrator.algo") -> Callable[[str], list[int]]:
        """opsd's demonstration message as ids: the algo's renderer (`algo`: unset, the run's
        [orchestrator.algo]), else the run's own (orchestrator.renderer), else the tokenizer's chat
        template."""
        from hpcrl.orchestrator.algo.reference import chat_template_hint

        section = (algo or self.cfg.orchestrator.algo).renderer
        renderers = self.renderers
        if section is not None:
            model = (self.cfg.orchestrator.model or self.cfg.model).name or ""
            renderers = load_renderers_of(section, self.tokenizer, model, f"{where}.renderer")
        renderer = None if renderers is None else renderers.get(None)
        return chat_template_hint(self.tokenizer, renderer)

    async def generate(self, refs: Sequence[TaskRef], step: int) -> list[GroupRecord]:
        assert self.train_gen is not None
        n = self.cfg.orchestrator.rollouts_per_example
        results = await asyncio.gather(
            *(
                self.train_gen.groups(
                    self.envs[r.env],
                    [self.tasks[r.env][r.index]],
                    n,
                    self.train_sampling,
                    "train",
                    step,
                    r.env,
                    r.epoch,
                )
                for r in refs
            )
        )
        return [
            GroupRecord(
                env=r.env,
                example_id=self.tasks[r.env][r.index].example_id,
                task_index=r.index,
                task_epoch=r.epoch,
                rollouts=res[0],
            )
            for r, res in zip(refs, results)
        ]

    def stopping(self) -> None:
        """The orchestrator was told to stop: an env server that ends from now on (SLURM signals every
        process of a step) ends with the run, and is neither restarted nor warned about."""
        for env in [*self.envs.values(), *(e.env for e in self.eval_envs)]:
            if hasattr(env, "stopping"):
                env.stopping = True

    async def aclose(self) -> None:
        for p in self.pools:
            await p.aclose()
        for env in [*self.envs.values(), *(e.env for e in self.eval_envs)]:
            close = getattr(env, "aclose", None)
            if close is not None:
                await close()


def build_poller(cfg: Config, pool: ServerPool, ceiling: int) -> Any:
    """The /metrics poller and in-flight controller of the student servers (issue 53): in fixed mode
    it only reports the gauges; the cap stays at `ceiling`."""
    from hpcrl.inference.guard import resolve_api_key
    from hpcrl.orchestrator.concurrency.controller import Controller
    from hpcrl.orchestrator.concurrency.poller import Poller

    conc = cfg.orchestrator.concurrency
    ctl = Controller(
        min_inflight=min(conc.min_inflight, ceiling),
        max_inflight=ceiling,
        initial_inflight=None if conc.initial_inflight is None else min(conc.initial_inflight, ceiling),
        adaptive=conc.mode == "adaptive",
        poll_interval_s=conc.poll_interval_s,
    )
    max_model_len = cfg.inference.max_model_len or cfg.seq_len
    return Poller(pool, ctl, max_model_len, resolve_api_key(cfg.server.api_key))


def algo_summary(algo: Any) -> str:
    """One line: what the algorithm trains on (for the orchestrator's log)."""
    frozen = algo.frozen
    where = "" if frozen is None else f"{frozen.base_url}" + (f" ({frozen.name})" if frozen.name else "")
    if algo.type == "echo":
        roles = ", ".join(
            f"{r} {c.alpha:g}"
            for r in ("system", "user", "assistant", "tool")
            if (c := getattr(algo.roles, r))
        )
        return (
            "policy-gradient loss on the policy's samples, advantages from rewards; plus cross entropy "
            f"on the env's later messages ({roles})"
            + (f", filtered by {algo.filter.import_path}" if algo.filter else "")
        )
    return {
        "rl": "policy-gradient loss on the policy's samples, advantages from rewards",
        "ref_kl": f"reverse KL to {where or 'the policy shown the task demonstration'}, per token",
        "ce": f"cross entropy on the samples of {where}",
    }[algo.action_loss]


def build(cfg: Config, paths: RunPaths) -> Setup:
    o = cfg.orchestrator
    served = {
        "server_dir": paths.env_server_dir,
        "run_dir": str(paths.root),
        "default_workers": o.env_workers,
        "max_restarts": o.env_server_max_restarts,
        "env_nodes": cfg.deployment.env_nodes,
        "frozen_s": FROZEN_FACTOR * cfg.stall_warning_s,
    }
    envs = load_envs(o.train.env, "orchestrator.train.env", kind="train", **served)
    if not envs:
        raise ConfigError("orchestrator.train.env", "at least one training environment is required")
    tasks: dict[str, Sequence[Task]] = {}
    for e in o.train.env:
        ts = envs[env_name(e)].tasks("train")
        tasks[env_name(e)] = ts if e.num_examples in (None, -1) else ts[: e.num_examples]
        if not tasks[env_name(e)]:
            raise ConfigError("orchestrator.train.env", f"environment {env_name(e)!r} has no training tasks")
    ratios = o.buffer.env_ratios
    if ratios is None and any(e.ratio is not None for e in o.train.env):
        ratios = [e.ratio if e.ratio is not None else 1.0 for e in o.train.env]
    b = o.buffer
    buffer = Buffer(
        {k: len(v) for k, v in tasks.items()},
        BufferConfig(
            online_difficulty_filtering=b.online_difficulty_filtering,
            easy_threshold=b.easy_threshold,
            hard_threshold=b.hard_threshold,
            easy_fraction=b.easy_fraction,
            hard_fraction=b.hard_fraction,
            env_ratios=None if ratios is None else tuple(ratios),
            oversampling_factor=o.oversampling_factor,
            max_off_policy_steps=o.max_off_policy_steps,
            seed=b.seed + o.seed + cfg.seed,
        ),
    )
    eval_envs = []
    if o.eval is not None:
        loaded = load_envs(o.eval.env, "orchestrator.eval.env", kind="eval", first=len(o.train.env), **served)
        for e in o.eval.env:
            n = e.num_examples if e.num_examples is not None else o.eval.num_examples
            eval_envs.append(
                EvalEnv(
                    env_name(e), loaded[env_name(e)], n, e.rollouts_per_example or o.eval.rollouts_per_example
                )
            )
    open_env_logs(cfg, paths, envs, eval_envs)
    world, servers, transport = deployment(cfg)
    if cfg.deterministic and transport == "collective" and o.max_async_level > 0:
        raise ConfigError(
            "deterministic",
            "true needs trainer.broadcast.transport = 'filesystem' when "
            "max_async_level > 0 (a collective broadcast cannot be loaded later)",
        )
    eval_sampling = eval_sampling_of(o)
    tokenizer = load_tokenizer(cfg)
    renderers = load_renderers(cfg, tokenizer)
    from hpcrl.orchestrator.causes import check_tools

    check_tools({**envs, **{e.env.name: e.env for e in eval_envs}}, renderers, tokenizer)
    from hpcrl.orchestrator.images import SampleImages, load_vision

    vision = load_vision(cfg, tokenizer)
    if vision is not None and renderers is not None:
        raise ConfigError(
            "orchestrator.renderer.name",
            f"{cfg.orchestrator.renderer.name!r} with [model.vlm]: a typed renderer samples token ids without "
            "the images; image prompts go through the chat template (leave the renderer unset)",
        )
    return Setup(
        images=None if vision is None else SampleImages(vision),
        cfg=cfg,
        tokenizer=tokenizer,
        renderers=renderers,
        envs=envs,
        tasks=tasks,
        buffer=buffer,
        credit=Credit(o.algo, o.advantage, {env_name(e): e.algo for e in o.train.env if e.algo is not None}),
        world_size=world,
        num_servers=servers,
        transport=transport,
        eval_envs=eval_envs,
        train_sampling=openai_sampling(o.train.sampling),
        eval_sampling=openai_sampling(eval_sampling),
    )


def eval_sampling_of(o: OrchestratorConfig) -> SamplingConfig:
    """Eval's sampling: its own table, else train's. The thinking switches are the model's prompt
    format, so eval keeps train's unless its table sets them."""
    t = o.train.sampling
    if o.eval is None or o.eval.sampling is None:
        return t
    e = o.eval.sampling
    return msgspec.structs.replace(
        e,
        enable_thinking=t.enable_thinking if e.enable_thinking is None else e.enable_thinking,
        reasoning_effort=e.reasoning_effort or t.reasoning_effort,
    )


def open_env_logs(
    cfg: Config, paths: RunPaths, envs: dict[str, Environment], eval_envs: list[EvalEnv]
) -> None:
    """logs/envs/{train,eval}/<env>.log (docs/architecture.md §4): what `hpcrl logs -c env:NAME` and tmux.sh follow."""
    from hpcrl.envs.verifiers.adapter03 import VerifiersEnvironment
    from hpcrl.monitor.logging import attach_env_logs

    files: dict[str, list[Path]] = {}
    for name in envs:
        files.setdefault(name, []).append(paths.env_log_file("train", name))
    for e in eval_envs:
        files.setdefault(e.name, []).append(paths.env_log_file("eval", e.name))
    vf = tuple(
        n
        for n, env in [*envs.items(), *((e.name, e.env) for e in eval_envs)]
        if isinstance(env, VerifiersEnvironment)
    )
    attach_env_logs(files, (cfg.orchestrator.log or cfg.log).vf_level, vf)


def load_renderers(cfg: Config, tokenizer: Any) -> Any:
    """The renderers of renderer-driven rollouts, or None when orchestrator.renderer resolves to the
    tokenizer's own template (then rollouts use hpcrl's exact stitching, see orchestrator/stitching.py)."""
    model = (cfg.orchestrator.model or cfg.model).name or ""
    return load_renderers_of(cfg.orchestrator.renderer, tokenizer, model, "orchestrator.renderer")


def load_renderers_of(section: Any, tokenizer: Any, model: str, field: str) -> Any:
    from hpcrl.render.select import typed_renderers

    return typed_renderers(tokenizer, section, model, field)


def load_tokenizer(cfg: Config) -> Any:
    from hpcrl.models.resolve import resolve_model
    from hpcrl.models.tokenizer import load_tokenizer as load

    model = cfg.orchestrator.model or cfg.model
    return load(resolve_model(model.name or ""), trust_remote_code=model.trust_remote_code)
