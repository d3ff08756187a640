"""The checks of [orchestrator.algo] that its types cannot express, as prime-rl makes them, plus the
older keys (training_mode, [orchestrator.teacher], advantage.length_penalty) that could not be folded
into it (hpcrl.config.sections.orchestrator.fold_older_keys). Each raises one ConfigError."""

from __future__ import annotations

import importlib
import math
from typing import Any

from hpcrl.config.sections.algo import ACTION_LOSS, TYPE_FIELDS, AlgoConfig, FrozenModelConfig
from hpcrl.errors import ConfigError

A = "orchestrator.algo"
# The reward-based types hpcrl's [orchestrator.advantage] knobs apply to.
REWARD_TYPES = ("grpo", "max_rl", "rae", "echo")
CENTRED_TYPES = ("grpo", "echo")  # where std_normalize means something (a group-centred advantage)


def check_algo(o: Any) -> None:
    """`o`: the OrchestratorConfig (after its __post_init__ folded what it could)."""
    _older_keys(o)
    algo: AlgoConfig = o.algo
    _own_fields(algo)
    _sampling_source(algo)
    if algo.type == "opd" and algo.teacher is None:
        raise ConfigError(f"{A}.teacher", "type = 'opd' needs [orchestrator.algo.teacher] name + base_url")
    if algo.type == "hierarchical_grpo":
        raise ConfigError(
            f"{A}.type",
            f"'hierarchical_grpo' (episode_agents {algo.episode_agents}) is not implemented in hpcrl (it "
            "needs the agent name of each trace of a proposer-solver episode); allowed: grpo, max_rl, rae, "
            "opd, opsd, sft",
        )
    if algo.type == "echo":
        _echo(algo)
    _advantage_knobs(o.advantage, algo.type)
    check_env_algos(o)


ENV_TYPES = ("grpo", "max_rl", "rae", "echo", "opd", "opsd")  # what one env may run beside the others


def check_env_algos(o: Any) -> None:
    """Per-env algorithms ([[orchestrator.train.env]] algo, prime-rl's per-source algo): each one is
    checked as [orchestrator.algo] is. The trainer runs one loss mode: the rl types and the ref_kl types
    (opd, opsd) mix, the run's own algo then being an rl type (the trainer's rl loss; the ref_kl envs'
    per-token signal rides in their advantages, hpcrl.orchestrator.algo.mixed); sft mixes with nothing."""
    own = [(i, e.algo) for i, e in enumerate(o.train.env) if e.algo is not None]
    if not own:
        return
    for i, algo in own:
        where = f"orchestrator.train.env[{i}].algo"
        if algo.type not in ENV_TYPES:
            raise ConfigError(
                f"{where}.type",
                f"'{algo.type}' per env is not supported here (allowed: {', '.join(ENV_TYPES)}; one run-wide "
                "[orchestrator.algo] for the others)",
            )
        try:
            _own_fields(algo)
            _sampling_source(algo)
            if algo.type == "echo":
                _echo(algo)
            if algo.type in REWARD_TYPES:  # the run-wide advantage knobs: on this env's rewards too
                _advantage_knobs(o.advantage, algo.type)
        except ConfigError as e:
            raise ConfigError(e.path.replace(A, where, 1), e.message) from None
        if algo.type == "opd" and algo.teacher is None:
            raise ConfigError(f"{where}.teacher", "type = 'opd' needs a teacher (name + base_url)")
    losses = {ACTION_LOSS[a.type] for a in env_algos(o)}
    if len(losses) > 1 and o.algo.action_loss != "rl":
        i = own[0][0]
        raise ConfigError(
            f"orchestrator.train.env[{i}].algo",
            f"mixes rl and ref_kl algorithms under orchestrator.algo.type = '{o.algo.type}': the trainer runs "
            "one loss, so set orchestrator.algo to an rl type (grpo, max_rl, rae) and give the opd / opsd "
            "envs their algo",
        )


def env_algos(o: Any) -> list[AlgoConfig]:
    """The algorithm of every train env: its own, else [orchestrator.algo]."""
    return [e.algo if e.algo is not None else o.algo for e in o.train.env]


def _older_keys(o: Any) -> None:
    if o.training_mode is not None:
        if o.algo is not None:
            raise ConfigError(
                "orchestrator.training_mode",
                "is the older name of orchestrator.algo.type; set only [orchestrator.algo]",
            )
        raise ConfigError(
            "orchestrator.teacher",
            f"training_mode = '{o.training_mode}' needs [orchestrator.teacher] base_url",
        )
    if o.teacher is not None:
        if o.algo is not None:
            raise ConfigError(
                "orchestrator.teacher",
                "is the older name of [orchestrator.algo.teacher] (opd) / [orchestrator.algo.sampling.source] "
                "(sft); with [orchestrator.algo] set, set those",
            )
        raise ConfigError("orchestrator.teacher", "is only used with training_mode = 'opd' or 'sft'")
    assert o.algo is not None, "fold_older_keys sets orchestrator.algo"
    if o.advantage.length_penalty > 0:
        why = (
            "conflicts with [orchestrator.algo.length_penalty] (its older name; set one)"
            if o.algo.length_penalty is not None
            else f"only type grpo / echo take a length penalty (type is '{o.algo.type}')"
        )
        raise ConfigError("orchestrator.advantage.length_penalty", why)


def _own_fields(algo: AlgoConfig) -> None:
    """A field of another type set to anything but its default is refused (prime-rl's union would not
    parse it), never ignored."""
    default = AlgoConfig(type=algo.type)
    for name, types in TYPE_FIELDS:
        if algo.type not in types and getattr(algo, name) != getattr(default, name):
            raise ConfigError(
                f"{A}.{name}", f"is a setting of type {' / '.join(types)}, not of type '{algo.type}'"
            )


def _sampling_source(algo: AlgoConfig) -> None:
    frozen = isinstance(algo.sampling.source, FrozenModelConfig)
    loss = ACTION_LOSS[algo.type]
    if frozen and loss != "ce":
        raise ConfigError(
            f"{A}.sampling.source",
            f"type '{algo.type}' trains with the {loss} loss, which needs the live policy's own sampling "
            "logprobs: allowed 'policy'; use type = 'sft' to distill a frozen model's tokens",
        )
    if not frozen and loss == "ce":
        raise ConfigError(
            f"{A}.sampling.source",
            "type 'sft' needs a frozen model to sample from ([orchestrator.algo.sampling.source] name + "
            "base_url): cross entropy on the policy's own tokens is no distillation target",
        )


def _echo(algo: AlgoConfig) -> None:
    """prime-rl's EchoRolesConfig / EchoFilterConfig checks; the filter is imported here, as prime-rl
    imports it when the algorithm starts (hpcrl.orchestrator.algo.echo)."""
    r = algo.roles
    if r.system is None and r.user is None and r.assistant is None and r.tool is None:
        raise ConfigError(f"{A}.roles", "echo needs at least one role (system, user, assistant or tool)")
    for name in ("system", "user", "assistant", "tool"):
        role = getattr(r, name)
        if role is not None and not math.isfinite(role.alpha):
            raise ConfigError(f"{A}.roles.{name}.alpha", f"{role.alpha}: allowed a finite weight > 0")
    if algo.filter is not None:
        path = algo.filter.import_path
        try:
            fn = import_object(path)
        except (ImportError, AttributeError) as e:
            raise ConfigError(
                f"{A}.filter.import_path",
                f"{path!r} cannot be imported ({type(e).__name__}: {e}); allowed: 'module.function' on the path",
            ) from None
        if not callable(fn):
            raise ConfigError(f"{A}.filter.import_path", f"{path!r} is a {type(fn).__name__}, not a callable")


def import_object(path: str) -> Any:
    """`package.module.name` or `package.module:name` -> the object (ImportError / AttributeError)."""
    module, sep, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module or not name:
        raise ImportError(f"{path!r} is not 'module.name' or 'module:name'")
    return getattr(importlib.import_module(module), name)


def _advantage_knobs(adv: Any, kind: str) -> None:
    if adv.std_normalize and kind not in CENTRED_TYPES:
        raise ConfigError(
            "orchestrator.advantage.std_normalize",
            f"divides a group-centred advantage: only type grpo / echo have one (type is '{kind}')",
        )
    if adv.reward_clip is not None and kind not in REWARD_TYPES:
        raise ConfigError(
            "orchestrator.advantage.reward_clip",
            f"type '{kind}' trains without rewards (allowed with {', '.join(REWARD_TYPES)})",
        )


def check_algo_room(cfg: Any) -> None:
    """opsd scores every sequence (up to seq_len tokens) with the demonstration message in front, on
    the policy's own servers: their context must be longer than seq_len."""
    if cfg.orchestrator.algo.type != "opsd":
        return
    room = cfg.inference.max_model_len or cfg.seq_len
    if room <= cfg.seq_len:
        raise ConfigError(
            "inference.max_model_len",
            f"{room}: type = 'opsd' scores each sequence (up to seq_len = {cfg.seq_len} tokens) with the "
            f"demonstration message prepended; allowed: above seq_len (e.g. {2 * cfg.seq_len})",
        )
