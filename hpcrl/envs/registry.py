"""Resolve an environment id to a factory and build it: `load_environment(env_id, **args)`.

Resolution order:
  1. a built-in by its own name (`reverse-text`, `reverse-text-demo`, `alphabet-sort`, `arithmetic`,
     `calculator`, `color-codeword`; `_` for `-` accepted; also `hpcrl/<name>`);
  2. `module:function` naming any importable factory;
  3. `owner/name` or `name`: the installed environment package, module `name` with `-` -> `_`
     (what `prime env install owner/name` installs), exposing `load_environment`; or an entry point
     in the `hpcrl.environments` / `verifiers.environments` groups;
  4. aliases: `primeintellect/reverse-text` and `primeintellect/alphabet-sort`, when no such package is
     installed, run the built-in of that name, which implements the same task (`alias_note` says so;
     the launcher and the orchestrator print it). Any other id that is not installed is an error that
     names the id and how to install it — never a silent stand-in.
A factory that returns a verifiers `vf.Environment` is wrapped in the verifiers adapter.

Every environment takes `system_prompt` (text; "" = none) and `system_prompt_file` (a file holding
it, e.g. GEPA's best_prompt.txt): a factory with a `system_prompt` parameter receives it, any other
environment gets it as `Environment.system_prompt_override`, which replaces every task's system
message.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hpcrl.envs.base import Environment
from hpcrl.errors import UserError

BUILTINS: dict[str, str] = {
    "reverse-text": "hpcrl.envs.builtin.reverse_text",
    "reverse-text-demo": "hpcrl.envs.builtin.reverse_text_demo",  # the CPU learning demo's defaults
    "alphabet-sort": "hpcrl.envs.builtin.alphabet_sort",
    "arithmetic": "hpcrl.envs.builtin.arithmetic",
    "calculator": "hpcrl.envs.builtin.calculator",
    "tool-think": "hpcrl.envs.builtin.tool_think",  # multi-turn tools + reasoning (renderer tests)
    "color-codeword": "hpcrl.envs.builtin.color_codeword",  # images (vision-language RL)
}
# Hub ids whose task a built-in implements (same prompts, parser and reward shape), used only when
# the package is not installed. `primeintellect/gsm8k` is deliberately not one: the built-in
# arithmetic env is synthetic, not GSM8K, so that id must be installed or it is an error.
ALIASES: dict[str, str] = {
    "primeintellect/reverse-text": "reverse-text",
    "primeintellect/alphabet-sort": "alphabet-sort",
}
OWN_OWNER = "hpcrl"
ENTRY_POINT_GROUPS = ("hpcrl.environments", "verifiers.environments")

Factory = Callable[..., Any]


class EnvSpecError(UserError, ValueError):
    """An environment id or arguments the user gave that cannot be used (unknown id, a package that
    fails to import, an unknown or invalid argument): one line naming the environment."""


def _normal(env_id: str) -> str:
    return env_id.strip().lower().replace("_", "-")


def _builtin_key(env_id: str) -> str | None:
    """The built-in `env_id` names directly (`reverse-text`, `hpcrl/reverse-text`), else None."""
    owner, _, name = _normal(env_id).rpartition("/")
    if owner and owner != OWN_OWNER:
        return None
    return name if name in BUILTINS else None


def _alias_key(env_id: str) -> str | None:
    return ALIASES.get(_normal(env_id))


def module_name(env_id: str) -> str:
    """The Python module an environment package installs: the id's name part, `-` -> `_`."""
    return env_id.strip().rpartition("/")[2].replace("-", "_")


def known_env_ids() -> list[str]:
    return sorted(BUILTINS)


def _unknown(env_id: str, why: str = "") -> EnvSpecError:
    return EnvSpecError(
        f"unknown environment {env_id!r}{why}; built-ins: {', '.join(known_env_ids())}; "
        f"otherwise give an installed environment package (owner/name), 'module:function', "
        f"or an entry point in {' / '.join(ENTRY_POINT_GROUPS)}"
    )


def _not_installed(env_id: str) -> EnvSpecError:
    return EnvSpecError(
        f"environment {env_id!r} is not installed (no module {module_name(env_id)!r} with load_environment): "
        f"install it into this venv with `prime env install {env_id.strip()}` (or pip install its package); "
        f"built-ins: {', '.join(known_env_ids())}"
    )


def _import(module_name: str, env_id: str) -> Any | None:
    """Import a module if it exists; a module that exists but fails to import is a user error
    worth surfacing (usually a missing dependency), not a 'not found'."""
    try:
        if importlib.util.find_spec(module_name) is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return importlib.import_module(module_name)
    except Exception as e:
        from hpcrl.envs.verifiers.versions import explain

        raise EnvSpecError(
            explain(env_id, e)
            or f"environment {env_id!r}: importing {module_name} failed: {type(e).__name__}: {e}"
        ) from e


def resolve_factory(env_id: str) -> Factory:
    """The callable that builds `env_id`; EnvSpecError when nothing matches."""
    if not env_id or not env_id.strip():
        raise _unknown(env_id)
    key = _builtin_key(env_id)
    if key is not None:
        return importlib.import_module(BUILTINS[key]).load_environment

    if ":" in env_id:
        mod_name, _, attr = env_id.partition(":")
        module = _import(mod_name, env_id)
        if module is None:
            raise _unknown(env_id, f" (no module {mod_name!r})")
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise _unknown(env_id, f" (module {mod_name!r} has no callable {attr!r})")
        return fn

    fn = _installed(env_id)
    if fn is not None:
        return fn
    alias = _alias_key(env_id)
    if alias is not None:
        return importlib.import_module(BUILTINS[alias]).load_environment
    raise _not_installed(env_id) if "/" in env_id else _unknown(env_id)


def _installed(env_id: str) -> Factory | None:
    """The installed package's load_environment (module, then entry points), else None."""
    name = env_id.rpartition("/")[2]
    for mod_name in dict.fromkeys([module_name(env_id), name]):
        if not all(part.isidentifier() for part in mod_name.split(".")):
            continue
        module = _import(mod_name, env_id)
        if module is not None and callable(getattr(module, "load_environment", None)):
            return module.load_environment
        if module is not None:
            from hpcrl.envs.verifiers.versions import v1_exports

            if v1_exports(module):  # a verifiers 0.4 taskset package (exports its Taskset via __all__)
                return _v1_factory(mod_name, env_id)
    wanted = {env_id, name, name.replace("-", "_"), name.replace("_", "-")}
    for group in ENTRY_POINT_GROUPS:
        for ep in importlib.metadata.entry_points(group=group):
            if ep.name in wanted:
                obj = ep.load()
                fn = getattr(obj, "load_environment", obj)  # an entry point may name the module
                if callable(fn):
                    return fn
    return None


def _v1_factory(mod_name: str, env_id: str) -> Factory:
    """A v1 taskset module: run it through verifiers' own env server (hpcrl.envs.verifiers.v1_env) where this
    venv has verifiers 0.4, else the one-line version refusal."""
    from hpcrl.envs.verifiers.versions import installed, major_minor, v1_refusal

    mm = major_minor(installed())
    if mm is None or mm < (0, 4):
        raise EnvSpecError(v1_refusal(env_id))
    if "." in mod_name:  # verifiers imports a taskset by its top-level module name only
        raise EnvSpecError(
            f"environment {env_id!r}: verifiers loads a v1 taskset by its top-level module name; install "
            f"it as a package (or put its folder on PYTHONPATH) and use id = {mod_name.rpartition('.')[2]!r}"
        )

    def build(**args: Any) -> Environment:
        from hpcrl.envs.verifiers.v1_env import V1Environment

        return V1Environment(mod_name, args)

    build.v1_module = mod_name  # type: ignore[attr-defined]  (load_envs starts its server)
    return build


def v1_module(env_id: str) -> str | None:
    """The taskset module of a verifiers v1 env id (this venv has 0.4), else None."""
    try:
        factory = resolve_factory(env_id)
    except EnvSpecError:
        return None
    return getattr(factory, "v1_module", None)


def alias_note(env_id: str) -> str | None:
    """`env X: not installed; running the built-in Y (alias)` when X resolves through an alias."""
    alias = _alias_key(env_id)
    if alias is None or _builtin_key(env_id) is not None or ":" in env_id or _installed(env_id) is not None:
        return None
    return (
        f"env {env_id}: package not installed; running the built-in '{alias}' (alias of the same task; "
        f"`prime env install {env_id}` to use the Hub package)"
    )


PROMPT_ARGS = ("system_prompt", "system_prompt_file")


def _accepts(factory: Factory, name: str) -> bool:
    params = inspect.signature(factory).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def split_prompt_args(
    env_id: str, factory: Factory, args: Mapping[str, Any]
) -> tuple[dict[str, Any], str | None]:
    """(the arguments for the factory, a system prompt to apply as an override or None). Reads
    `system_prompt_file` unless the factory takes that argument itself."""
    args = dict(args)
    if "system_prompt_file" in args and not _accepts(factory, "system_prompt_file"):
        if "system_prompt" in args:
            raise EnvSpecError(f"environment {env_id!r}: give system_prompt or system_prompt_file, not both")
        path = args.pop("system_prompt_file")
        try:
            args["system_prompt"] = Path(str(path)).read_text().strip()
        except OSError as e:
            raise EnvSpecError(f"environment {env_id!r}: system_prompt_file {path!r}: {e.strerror}") from None
    prompt = args.get("system_prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise EnvSpecError(
            f"environment {env_id!r}: system_prompt must be a string, got {type(prompt).__name__}"
        )
    if "system_prompt" in args and not _accepts(factory, "system_prompt"):
        return args, args.pop("system_prompt")
    return args, None


def _check_args(env_id: str, factory: Factory, args: Mapping[str, Any]) -> None:
    sig = inspect.signature(factory)
    params = sig.parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        accepted = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        for arg in args:
            if arg not in params:
                raise EnvSpecError(
                    f"environment {env_id!r}: unknown argument {arg!r}; accepted: {', '.join(accepted) or '(none)'}"
                )
    try:
        sig.bind(**args)
    except TypeError as e:
        raise EnvSpecError(f"environment {env_id!r}: {e}") from e


def _build(env_id: str, factory: Factory, args: Mapping[str, Any]) -> Any:
    _check_args(env_id, factory, args)
    try:
        return factory(**args)
    except (TypeError, ValueError) as e:
        raise EnvSpecError(f"environment {env_id!r}: {e}") from e
    except (AttributeError, ImportError) as e:  # the other verifiers API?
        from hpcrl.envs.verifiers.versions import explain

        why = explain(env_id, e)
        if why is None:
            raise
        raise EnvSpecError(why) from e


def load_environment(env_id: str, **args: Any) -> Environment:
    """Build an environment by id; EnvSpecError (one line) for unknown ids or bad arguments.
    `${env:NAME}` references in args are resolved here, in the process that runs the environment."""
    from hpcrl.config.secrets import resolve_refs
    from hpcrl.errors import ConfigError

    try:
        args = resolve_refs(args, f"environment {env_id!r} args")
    except ConfigError as e:
        raise EnvSpecError(f"{e.path}: {e.message}") from None
    factory = resolve_factory(env_id)
    args, override = split_prompt_args(env_id, factory, args)
    env = _build(env_id, factory, args)
    if not isinstance(env, Environment):
        from hpcrl.envs.verifiers.adapter03 import is_verifiers_env, wrap_verifiers_env
        from hpcrl.envs.verifiers.versions import is_v1_object, v1_refusal

        if is_v1_object(env):
            raise EnvSpecError(v1_refusal(env_id))

        if not is_verifiers_env(env):
            raise _wrong_type(env_id, env)
        env = wrap_verifiers_env(env, name=env_id)
    if override is not None:
        env.system_prompt_override = override
    return env


def _wrong_type(env_id: str, env: Any) -> EnvSpecError:
    return EnvSpecError(
        f"environment {env_id!r}: the factory returned {type(env).__name__}, "
        "expected an hpcrl Environment or a verifiers Environment"
    )


def validate_env_spec(env_id: str, args: Mapping[str, Any] | None = None) -> None:
    """Check that `env_id` resolves and `args` fit its factory, without loading data or models.
    Built-ins are also constructed (their tasks are generated lazily), so value errors such as
    min_len > max_len surface here too."""
    factory = resolve_factory(env_id)
    args, _ = split_prompt_args(env_id, factory, args or {})
    if _builtin_key(env_id) is not None or alias_note(env_id) is not None:
        _build(env_id, factory, args)
    else:
        _check_args(env_id, factory, args)
