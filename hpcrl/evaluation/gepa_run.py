"""`hpcrl gepa run`: optimise one environment's system prompt with GEPA (the `gepa` package).

    env + train/val tasks -> endpoints (task model, reflection model) -> gepa.optimize(PromptAdapter)
    -> best_prompt.txt (+ system_prompt.txt), pareto_frontier.jsonl, metadata.json, results.jsonl

Resume: gepa keeps its state in <output_dir>/gepa/ and continues from it when the same output dir is
given again (a larger -B extends a finished search). The environment, model and data sizes must
match the first invocation (config.json is compared).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import msgspec

from hpcrl.config.schema import GepaRunConfig
from hpcrl.envs.base import Environment, Task
from hpcrl.errors import ConfigError
from hpcrl.evaluation.endpoint import Endpoints, load_tokenizer
from hpcrl.evaluation.gepa_adapter import (
    COMPONENT,
    BudgetStopper,
    GepaLog,
    PromptAdapter,
    ReflectionLM,
    prompt_key,
)
from hpcrl.evaluation.rollouts import make_generator
from hpcrl.evaluation.run import default_output_dir, write_json, write_jsonl
from hpcrl.fileio import write_atomic
from hpcrl.paths import EvalPaths

log = logging.getLogger("hpcrl.evaluation")

FALLBACK_PROMPT = "You are a helpful assistant."
# What must not change between a search and its resume (the rest, e.g. the budget, may).
RESUME_KEYS = ("model", "env", "gepa.num_train", "gepa.num_val", "gepa.minibatch_size", "seed", "sampling")


def _import_gepa() -> Any:
    try:
        import gepa
    except ImportError:
        raise ConfigError("gepa", "needs the gepa package: pip install 'hpcrl[gepa]'") from None
    return gepa


def base_prompt(cfg: GepaRunConfig, env: Environment, tasks: list[Task]) -> str:
    """The seed candidate: gepa.initial_prompt, else the environment's own system prompt."""
    if cfg.gepa.initial_prompt is not None:
        return cfg.gepa.initial_prompt
    first = env.initial_messages(tasks[0]) if tasks else []
    own = first[0]["content"] if first and first[0].get("role") == "system" else ""
    return own or FALLBACK_PROMPT


def split_tasks(cfg: GepaRunConfig, env: Environment) -> tuple[list[Task], list[Task]]:
    train = list(env.tasks("train"))[: cfg.gepa.num_train]
    val = list(env.tasks("eval"))[: cfg.gepa.num_val]
    if not train or not val:
        raise ValueError(
            f"env {cfg.env[0].id!r} has {len(train)} train and {len(val)} eval tasks; GEPA needs both"
        )
    return train, val


def check_budget(cfg: GepaRunConfig, num_val: int) -> None:
    g = cfg.gepa
    if num_val > g.max_calls:
        raise ConfigError(
            "gepa.max_calls",
            f"{g.max_calls} is below num_val ({num_val}): scoring the base prompt alone takes num_val calls",
        )
    if num_val + 2 * g.minibatch_size + num_val > g.max_calls:
        log.warning(
            "gepa: a budget of %d covers the base evaluation but no iteration (one takes up to %d calls)",
            g.max_calls,
            2 * g.minibatch_size + num_val,
        )


def _resume_view(cfg_dict: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key in RESUME_KEYS:
        v: Any = cfg_dict
        for part in key.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        out[key] = v
    return out


def check_resume(paths: EvalPaths, cfg_dict: dict[str, Any]) -> bool:
    """True when a previous search lives in this output dir (and fits this config)."""
    state = paths.gepa_state_dir / "gepa_state.bin"
    if not state.exists():
        return False
    if paths.config_file.exists():
        before, now = _resume_view(json.loads(paths.config_file.read_text())), _resume_view(cfg_dict)
        diff = [k for k in RESUME_KEYS if before[k] != now[k]]
        if diff:
            raise ConfigError(
                diff[0],
                f"differs from the search being resumed in {paths.root} "
                f"({before[diff[0]]!r} there); use another --output-dir",
            )
    return True


def main(cfg: GepaRunConfig) -> int:
    from hpcrl.monitor.logging import setup_logging
    from hpcrl.orchestrator.setup import env_name, load_envs

    gepa = _import_gepa()
    if len(cfg.env) != 1:
        raise ConfigError("env", f"gepa optimises one environment's prompt; {len(cfg.env)} were given")
    if cfg.output_dir is None:
        cfg.output_dir = default_output_dir("gepa", cfg, stamp=False)
    paths = EvalPaths(cfg.output_dir)
    setup_logging("gepa", cfg.log.level, log_file=paths.log_file("gepa"))
    cfg_dict = msgspec.to_builtins(cfg)
    resumed = check_resume(paths, cfg_dict)
    name = env_name(cfg.env[0])
    # the env runs in its own env server (logs/envs/eval/<env>/), as in training and `hpcrl eval`;
    # each candidate prompt travels with every rollout (wire.Run.system_prompt)
    env = load_envs(cfg.env, "env", kind="eval", server_dir=paths.env_server_dir)[name]
    loop = asyncio.new_event_loop()
    try:
        train, val = split_tasks(cfg, env)
        check_budget(cfg, len(val))
        write_json(paths.config_file, cfg_dict)
        seed_prompt = base_prompt(cfg, env, val)
        with Endpoints(paths, cfg.client, cfg.inference, cfg.seq_len, cfg.log.level) as ep:
            result, adapter, reflection = _search(
                gepa, cfg, paths, ep, loop, name, env, train, val, seed_prompt, resumed
            )
            rows = adapter.val_rows.get(prompt_key(result.candidates[result.best_idx][COMPONENT]), [])
            reflection.close()
            loop.run_until_complete(adapter.gen.pool.aclose())
    finally:
        close = getattr(env, "aclose", None)  # the env server (a workers = 0 env needs nothing)
        if close is not None:
            loop.run_until_complete(close())
        loop.close()
    meta = write_outputs(paths, cfg_dict, result, val, rows, resumed, adapter.rollouts, reflection.calls)
    print(
        f"hpcrl gepa: {meta['num_candidates']} candidates, base {meta['base_score']:.3f} -> best "
        f"{meta['best_score']:.3f} (candidate {meta['best_idx']}), {meta['total_metric_calls']}/"
        f"{cfg.gepa.max_calls} metric calls{' (resumed)' if resumed else ''} -> {paths.best_prompt_file}",
        flush=True,
    )
    return 0


def _search(
    gepa: Any,
    cfg: GepaRunConfig,
    paths: EvalPaths,
    ep: Endpoints,
    loop: asyncio.AbstractEventLoop,
    name: str,
    env: Environment,
    train: list[Task],
    val: list[Task],
    seed_prompt: str,
    resumed: bool,
) -> tuple[Any, PromptAdapter, ReflectionLM]:
    from hpcrl.orchestrator.chat import openai_sampling

    g = cfg.gepa
    url = ep.url(cfg.model)
    tokenizer = load_tokenizer(cfg.model, cfg.client, cfg.inference.trust_remote_code)
    gen = make_generator(cfg, url, tokenizer, ep.api_key())
    adapter = PromptAdapter(loop, gen, name, env, openai_sampling(cfg.sampling), val, g.state_columns)
    if resumed:
        from gepa.core.state import GEPAState

        adapter.replay_base(GEPAState.load(str(paths.gepa_state_dir)).prog_candidate_val_subscores[0])
    reflection_model = g.reflection_model or cfg.model
    if g.reflection_base_url:
        import os

        r_url, r_key = g.reflection_base_url, os.environ.get(g.reflection_api_key_var)
    else:
        r_url, r_key = ep.url(reflection_model), ep.api_key()
    reflection = ReflectionLM(
        loop,
        r_url,
        reflection_model,
        r_key,
        g.reflection_max_tokens,
        g.reflection_temperature,
        cfg.client.timeout_s,
    )
    result = gepa.optimize(
        seed_candidate={COMPONENT: seed_prompt},
        trainset=train,
        valset=val,
        adapter=adapter,
        reflection_lm=reflection,
        candidate_selection_strategy=g.candidate_selection,
        skip_perfect_score=g.perfect_score is not None,
        perfect_score=g.perfect_score if g.perfect_score is not None else 1.0,
        reflection_minibatch_size=g.minibatch_size,
        stop_callbacks=[BudgetStopper(g.max_calls, g.minibatch_size, len(val))],
        run_dir=str(paths.gepa_state_dir),
        logger=GepaLog(),
        seed=g.seed,
        raise_on_exception=False,
        display_progress_bar=False,
    )
    return result, adapter, reflection


def write_outputs(
    paths: EvalPaths,
    cfg_dict: dict[str, Any],
    result: Any,
    val: list[Task],
    rows: list[dict[str, Any]],
    resumed: bool,
    rollouts: int,
    reflections: int,
) -> dict[str, Any]:
    best = result.candidates[result.best_idx][COMPONENT]
    for f in (paths.best_prompt_file, paths.system_prompt_file):
        write_atomic(f, [(best + "\n").encode()])
    frontier = []
    for vid, idxs in sorted(result.per_val_instance_best_candidates.items()):
        ranked = sorted(idxs)
        frontier.append(
            {
                "val_index": vid,
                "example_id": val[vid].example_id,
                "best_score": max(result.val_subscores[i][vid] for i in ranked) if ranked else None,
                "candidates": ranked,
                "prompts": [result.candidates[i][COMPONENT] for i in ranked],
            }
        )
    write_jsonl(paths.pareto_file, frontier)
    write_jsonl(paths.results_file, rows)
    meta = {
        "num_candidates": result.num_candidates,
        "best_idx": result.best_idx,
        "best_score": result.val_aggregate_scores[result.best_idx],
        "base_score": result.val_aggregate_scores[0],
        "total_metric_calls": result.total_metric_calls,
        "max_calls": cfg_dict["gepa"]["max_calls"],
        "resumed": resumed,
        "rollouts_this_invocation": rollouts,
        "reflection_calls_this_invocation": reflections,
        "num_val": len(val),
        "base_prompt": result.candidates[0][COMPONENT],
        "best_prompt": best,
        "candidates": [
            {
                "idx": i,
                "score": result.val_aggregate_scores[i],
                "parents": result.parents[i],
                "discovered_at_metric_calls": result.discovery_eval_counts[i],
            }
            for i in range(result.num_candidates)
        ],
        "config": cfg_dict,
    }
    write_json(paths.metadata_file, meta)
    return meta
