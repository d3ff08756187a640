"""Config loading: TOML files (`cfg.toml` or `@ a.toml @ b.toml`), dotted kebab-case flags, hosted shape.

Order: files merge left to right (tables deep-merge, lists replace), then flags override. The hosted
(flat) shape is translated to the native shape before the flags apply, shared top-level fields flow
into sections, and the result is converted to typed Structs. Every mistake is a ConfigError.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from hpcrl.config import fields, hosted, prime_model, prime_names, prime_shapes, roles, sanity
from hpcrl.config.dicts import deep_merge, get_path, set_path
from hpcrl.config.schema import Config, SFTConfig, TrainerConfig
from hpcrl.config.sections.model import owner_hint
from hpcrl.errors import ConfigError, nearest, show_key

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

T = TypeVar("T", bound=msgspec.Struct)


@dataclass
class Loaded:
    """A resolved config plus what the loader noticed (ignored platform fields, translations)."""

    config: Any
    notes: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# TOML files and merging
# ---------------------------------------------------------------------------------------------
def read_toml(path: str | Path) -> dict[str, Any]:
    shown = str(path) if str(path).strip() else repr(str(path))
    p = Path(path)
    if not p.is_file():
        raise ConfigError(shown, "config file not found")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(shown, f"invalid TOML: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(shown, "not a UTF-8 text file") from None
    except RecursionError:  # tomllib recurses per nested array / inline table
        raise ConfigError(shown, f"nested more than {sanity.MAX_DEPTH} levels deep") from None
    except OSError as e:
        raise ConfigError(shown, f"cannot be read ({e.strerror})") from None
    sanity.check_depth(data, "", source=shown)
    sanity.check_text(data)
    return data


# ---------------------------------------------------------------------------------------------
# argv
# ---------------------------------------------------------------------------------------------
_FLAG_RE = re.compile(r"^--(no-)?([A-Za-z0-9][A-Za-z0-9_.\-]*)$")


def _parse_value(raw: str, leaf: fields.Leaf) -> Any:
    """Flags carry TOML literals (64, 3e-6, true, [1, 2]); strings may be bare."""
    if leaf.type_repr.startswith("str") or "|" in leaf.type_repr and "int" not in leaf.type_repr:
        return raw
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw
    except RecursionError:
        raise ConfigError(leaf.path, f"value nested more than {sanity.MAX_DEPTH} levels deep") from None
    sanity.check_depth(value, leaf.path)
    return value


def parse_argv(
    argv: list[str], root: type[msgspec.Struct] = Config, role: str | None = None
) -> tuple[list[str], dict[str, Any]]:
    """Split argv into config files (in order) and a nested dict of flag overrides. With a `role`
    (hpcrl trainer / orchestrator / inference), a flag that role does not read is refused."""
    files: list[str] = []
    over: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "@":
            if i + 1 >= len(argv):
                raise ConfigError("@", "expected a TOML file after '@'")
            files.append(argv[i + 1])
            i += 2
            continue
        if tok.startswith("@") and len(tok) > 1:
            files.append(tok[1:])
            i += 1
            continue
        if not tok.startswith("--"):
            if tok.endswith(".toml"):
                files.append(tok)
                i += 1
                continue
            raise ConfigError(
                tok if tok.strip() else repr(tok),
                "unexpected argument (config files end in .toml; flags start with --)",
            )
        value: str | None = None
        if "=" in tok:
            tok, value = tok.split("=", 1)
        m = _FLAG_RE.match(tok)
        if not m:
            raise ConfigError(tok, "malformed flag (expected --section.field-name VALUE)")
        negated = bool(m.group(1))
        parts = [p.replace("-", "_") for p in m.group(2).split(".")]
        typed = parts
        if root is Config:
            parts = canonical_path(parts)  # --orchestrator.group-size sets rollouts_per_example
        leaf = fields.resolve(root, parts)
        if role is not None and not roles.reads(role, leaf.path):
            others = ", ".join(f"hpcrl {r}" for r in roles.owner_commands(leaf.path)) or "no role alone"
            raise ConfigError(
                leaf.path, f"is not read by `hpcrl {role}` (read by {others}; `hpcrl run` takes every field)"
            )
        if parts != typed:  # errors name the flag as given, and what it sets
            leaf = replace(leaf, path=f"{'.'.join(typed)} (= {leaf.path})")
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        i += 1
        if negated:
            if value is not None:
                raise ConfigError(leaf.path, "--no-… flags take no value")
            if leaf.kind == "bool":
                set_path(over, parts, False)
            elif leaf.optional_section:
                set_path(over, parts, None)
            else:
                raise ConfigError(
                    leaf.path, f"is a {leaf.type_repr}; --no- works only on booleans and optional sections"
                )
            continue
        if leaf.kind == "section":
            if value is not None and value.startswith("@") and not value[1:].strip():
                raise ConfigError(
                    leaf.path,
                    "expected a TOML file after '@' (--section=@file.toml or --section @ file.toml)",
                )
            if value is None and nxt == "@":
                if i + 1 >= len(argv):
                    raise ConfigError(leaf.path, "expected a TOML file after '@'")
                set_path(over, parts, deep_merge(get_path(over, parts) or {}, read_toml(argv[i + 1])))
                i += 2
            elif value is not None and value.startswith("@"):
                set_path(over, parts, deep_merge(get_path(over, parts) or {}, read_toml(value[1:])))
            elif value is None:
                if not leaf.optional_section:
                    raise ConfigError(leaf.path, "is a section: set one of its fields, or give '@ file.toml'")
                if get_path(over, parts) is None:
                    set_path(over, parts, {})
            else:
                raise ConfigError(leaf.path, "is a section: set one of its fields, or give '@ file.toml'")
            continue
        if leaf.kind == "bool":
            if value is None and nxt is not None and nxt.lower() in ("true", "false"):
                value = nxt
                i += 1
            if value is None:
                set_path(over, parts, True)
            elif value.lower() in ("true", "false"):
                set_path(over, parts, value.lower() == "true")
            else:
                raise ConfigError(leaf.path, f"expected true or false, got '{value}'")
            continue
        if value is None:
            if nxt is None or (nxt.startswith("--") and not _is_number(nxt)):
                raise ConfigError(leaf.path, f"flag needs a value ({leaf.type_repr})")
            value = nxt
            i += 1
        set_path(over, parts, _parse_value(value, leaf))
    return files, over


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------
# aliases, shared fields, conversion
# ---------------------------------------------------------------------------------------------
_ALIASES = [
    # (alias path, field path): prime-rl's names for hpcrl's fields
    (["orchestrator", "group_size"], ["orchestrator", "rollouts_per_example"]),
    (
        ["orchestrator", "train", "sampling", "max_completion_tokens"],
        ["orchestrator", "train", "sampling", "max_tokens"],
    ),
    (
        ["orchestrator", "eval", "sampling", "max_completion_tokens"],
        ["orchestrator", "eval", "sampling", "max_tokens"],
    ),
    (["ckpt", "weights", "save_adapter_separately"], ["ckpt", "save_adapter_separately"]),
    # seq_len is declared once, at the top level; a role section's (prime-rl writes [trainer] seq_len)
    # is the same setting
    (["trainer", "seq_len"], ["seq_len"]),
    (["model", "seq_len"], ["seq_len"]),  # prime-rl's trainer model table (and SFT's) carries it
    (["orchestrator", "seq_len"], ["seq_len"]),
    (["inference", "seq_len"], ["seq_len"]),
    # prime-rl's trainer model and trainer keys (issue 50; hpcrl.config.prime_model translates their values)
    (["trainer", "model", "seq_len"], ["seq_len"]),
    *[
        ([*m, a], [*m, f])
        for m in (["model"], ["trainer", "model"])
        for a, f in prime_model.MODEL_ALIASES.items()
    ],
    (["trainer", "enable_router_replay"], ["trainer", "model", "router_replay"]),
    (["trainer", "ckpt", "skip_optimizer"], ["ckpt", "skip_optimizer"]),
    (["trainer", "ckpt", "skip_scheduler"], ["ckpt", "skip_scheduler"]),
]


def canonical_path(parts: list[str]) -> list[str]:
    """A flag's field path with an alias (prime-rl's name) replaced by hpcrl's field."""
    for alias, canonical in _ALIASES:
        if parts == alias:
            return list(canonical)
    return prime_names.canonical_prefix(parts)  # --orchestrator.sampling.x: prime-rl's section names


def apply_aliases(d: dict[str, Any]) -> None:
    """Move every alias's value to its field (same value set both ways is fine, different is an
    error); a table left empty by the move (`[ckpt.weights]`) goes too."""
    for alias, canonical in _ALIASES:
        parent = get_path(d, alias[:-1])
        if not isinstance(parent, dict) or alias[-1] not in parent:
            continue
        value = parent.pop(alias[-1])
        current = get_path(d, canonical)
        if current is not None and current != value:
            raise ConfigError(
                ".".join(alias),
                f"conflicts with {'.'.join(canonical)} = {current!r} (they are the same setting)",
            )
        set_path(d, canonical, value)
        for k in range(len(alias) - 1, 0, -1):  # drop tables the move emptied
            table = get_path(d, alias[:k])
            if isinstance(table, dict) and not table:
                get_path(d, alias[: k - 1]).pop(alias[k - 1])


_MODEL_SECTIONS = (["model"], ["trainer", "model"], ["orchestrator", "model"], ["inference", "model"])
_SHARED = {
    "max_steps": (["max_steps"], ["trainer", "max_steps"], ["orchestrator", "max_steps"]),
    "model.name": tuple(p + ["name"] for p in _MODEL_SECTIONS),
}


def check_shared(d: dict[str, Any]) -> dict[str, Any]:
    """Shared fields set in several places must agree; returns {name: value} of those set anywhere."""
    resolved: dict[str, Any] = {}
    for name, places in _SHARED.items():
        seen: list[tuple[str, Any]] = []
        for parts in places:
            v = get_path(d, parts)
            if v is not None:
                seen.append((".".join(parts), v))
        for path, v in seen[1:]:
            if v != seen[0][1]:
                raise ConfigError(
                    path,
                    f"{v!r} conflicts with {seen[0][0]} = {seen[0][1]!r} (shared fields must agree; set it once)",
                )
        if seen:
            resolved[name] = seen[0][1]
    return resolved


def flow_models(merged: dict[str, Any]) -> None:
    """Each role's model section = the fields of [model] that the role has, under the role's own
    values (field by field): `[model] dtype` reaches every role, `[model] ep` only the trainer, and
    `[inference.model] dtype` overrides [model]'s for the servers alone. Runs on the merged dict
    (shapes already checked), so what a role reads is decided once, before conversion."""
    from hpcrl.config.sections.model import ROLE_MODELS

    top = merged.get("model")
    top = top if isinstance(top, dict) else {}
    for role, cls in ROLE_MODELS.items():
        inherited = {k: v for k, v in top.items() if k in cls.__struct_fields__}
        section = merged.setdefault(role, {})
        own = section.get("model")
        section["model"] = deep_merge(inherited, own if isinstance(own, dict) else {})


def flow_shared(cfg: Config) -> None:
    """Copy the resolved shared values into every section, so each role reads its own section."""
    inf_model = cfg.inference.model
    lora = cfg.trainer.model.lora if cfg.trainer.model is not None else None
    if inf_model is not None and inf_model.max_lora_rank is None and lora is not None:
        inf_model.max_lora_rank = lora.rank  # servers load the adapters the trainer makes
    cfg.trainer.max_steps = cfg.max_steps
    cfg.orchestrator.max_steps = cfg.max_steps
    if cfg.inference.max_model_len is None:  # opsd scores a sequence with a demonstration before it
        opsd = cfg.orchestrator.algo is not None and cfg.orchestrator.algo.type == "opsd"
        cfg.inference.max_model_len = cfg.seq_len * (2 if opsd else 1)


_AT_RE = re.compile(r"`\$(?P<path>[^`]*)`")


def _dotted(jsonpath: str) -> str:
    """`$.orchestrator.train.env[0].id` -> `orchestrator.train.env[0].id`."""
    return jsonpath.lstrip(".")


def convert(d: dict[str, Any], root: type[T]) -> T:
    """msgspec conversion with errors translated into one-line ConfigErrors; floats must be finite."""
    sanity.check_text(d)  # NUL bytes / undecodable argv bytes: named here, not crashed on later
    # load() checked the user's shape at MAX_DEPTH; flow_models moves [model] one level down into
    # each role, so a value the user nested right at the limit is converted (and named) at model.*.
    sanity.check_depth(d, "", limit=sanity.MAX_DEPTH + 1)
    try:
        out = msgspec.convert(d, root, strict=False)
    except msgspec.ValidationError as e:
        raise _translate(str(e), root, d) from None
    sanity.check_finite(out)
    return out


_MISSING = object()


def _value_at(d: Any, path: str) -> Any:
    """The raw value at `a.b[2].c` in the merged dict (for 'got ...' in messages)."""
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if part.startswith("["):
            i = int(part[1:-1])
            if not isinstance(d, list) or i >= len(d):
                return _MISSING
            d = d[i]
        elif isinstance(d, dict) and part in d:
            d = d[part]
        else:
            return _MISSING
    return d


def _allowed(root: type[msgspec.Struct], path: str) -> str:
    """`rl, opd, sft` for a Literal field, else ''."""
    parts = [p for p in re.sub(r"\[\d+\]", "", path).split(".") if p]
    try:
        leaf = fields.resolve(root, parts)
    except ConfigError:
        return ""
    options = leaf.type_repr.removesuffix(" (optional)")
    return ", ".join(options.split("|")) if "|" in options and " " not in options else ""


def _translate(msg: str, root: type[msgspec.Struct], d: dict[str, Any] | None = None) -> ConfigError:
    head, _, at = msg.rpartition(" - at ")
    if not head:
        head, at = msg, "`$`"
    m = _AT_RE.search(at)
    path = _dotted(m.group("path")) if m else ""
    unknown = re.match(r"Object contains unknown field `(.*)`$", head, re.DOTALL)
    if unknown:
        key = unknown.group(1)
        parts = [p for p in re.sub(r"\[\d+\]", "", path).split(".") if p]
        options = fields.field_names(root, parts)
        full = f"{path}.{show_key(key)}" if path else show_key(key)
        where = path or "top level"
        owned = owner_hint(path, key)
        return ConfigError(full, owned or f"unknown field in {where}{nearest(key, options)}")
    missing = re.match(r"Object missing required field `(.*)`$", head, re.DOTALL)
    if missing:
        key = missing.group(1)
        return ConfigError(f"{path}.{key}" if path else key, "required field is missing")
    text = head.replace("`", "")
    text = text[0].lower() + text[1:] if text else text
    for js, toml in (("object", "table"), ("array", "list")):  # msgspec speaks JSON; users wrote TOML
        text = re.sub(rf"\b{js}\b", toml, text)
    value = _value_at(d, path) if d is not None and path else _MISSING
    if text.startswith("invalid enum value"):
        allowed = _allowed(root, path)
        text = text.replace("invalid enum value", "invalid value") + (
            f" (allowed: {allowed})" if allowed else ""
        )
    elif value is not _MISSING and not isinstance(value, (dict, list)):
        text += f" ({value!r} given)" if " got " in f" {text}" else f", got {value!r}"
    return ConfigError(path or "config", text)


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------
def load(
    argv: list[str],
    root: type[T] = Config,
    require_envs: bool = True,  # type: ignore[assignment]
    extra: dict[str, Any] | None = None,
    role: str | None = None,
    checks: Callable[[Any], list[str]] | None = None,
) -> Loaded:
    """Resolve a config from CLI arguments (files + flags) into typed Structs. `extra` (a nested
    dict, e.g. from a command's positional arguments and short flags) applies after the flags.
    `role`: a role command's view (hpcrl.config.roles): flags it does not read are refused.
    `checks`: the checks that need role knowledge (hpcrl.launch.checks.role_checks, which passes
    itself in): run on the typed config inside this error boundary; they return notes to print."""
    notes: list[str] = []
    if root in (Config, SFTConfig):  # prime-rl's flags: --resume, --clean, --monitors.*, --weight-broadcast.*
        argv = prime_shapes.rewrite_argv(argv, notes)
    if root is Config:
        argv, platform = prime_names.strip_platform_flags(argv)  # --image-tag, --orchestrator.prime-monitor
        notes.extend(platform)
    files, over = parse_argv(argv, root, role)
    over = deep_merge(over, extra or {})
    sanity.check_text(over)  # named as the flag wrote it, before the value flows into role sections
    merged: dict[str, Any] = {}
    any_hosted = False
    for f in files:
        data = read_toml(f)
        if root is Config:
            if role is not None:  # prime-rl's split role files: the role's keys at the top level
                data = prime_shapes.split_role_file(
                    data, role, tuple(Config.__struct_fields__), str(f), notes
                )
            any_hosted = any_hosted or hosted.is_hosted(data)
            data, file_notes = hosted.to_native(data, source=str(f))
            notes.extend(file_notes)
        if root in (Config, SFTConfig):
            prime_shapes.translate(data, str(f), notes, sft=root is SFTConfig)
            prime_model.translate(data)  # compile = "None", full_offload = true, ... (SFT: its aliases too)
        elif root.__name__ == "EvalRunConfig":  # prime-rl's `evals` configs
            prime_shapes.translate_eval(data, str(f), notes)
        if root is Config:
            prime_names.move_sections(data, str(f), notes)
            apply_aliases(data)  # per file: a later file or a flag overrides an alias like its field
        merged = deep_merge(merged, data)
    sanity.check_shapes(merged, root)  # the files' own shapes: a flag like --slurm must not mask `slurm = 5`
    merged = deep_merge(merged, over)
    # `--no-x` on an optional section left None in the dict: that means "absent".
    _drop_nones(merged)
    sanity.check_depth(merged, "")  # in the user's shape: a flag's value adds to the depth it lands at
    try:
        sanity.check_shapes(merged, root)  # before any default is derived from a section
        if root in (Config, SFTConfig):
            prime_model.translate(merged)  # a flag's "disabled" (fused_lm_head_token_chunk_size)
        if root is Config:
            apply_aliases(merged)
            if any_hosted:
                hosted.apply_defaults(merged, notes)
            shared = check_shared(merged)
            if "model.name" in shared:
                set_path(merged, ["model", "name"], shared["model.name"])
            else:
                prime_shapes.default_model(merged, notes)
            for key in ("max_steps",):
                if key in shared:
                    merged[key] = shared[key]
            flow_models(merged)
            _micro_batch_default(merged)
            _role_log_extras(merged)
        if root is SFTConfig:
            prime_shapes.sft_defaults(merged, notes)
        if root in (Config, SFTConfig):
            prime_names.merge_role_logs(merged)
        cfg = convert(merged, root)
        from hpcrl.config.validate import validate, validate_sft

        if isinstance(cfg, Config):
            flow_shared(cfg)
            prime_names.default_eval_envs(cfg, notes)
            _load_env_files(cfg)
            validate(cfg, require_envs=require_envs)
            prime_names.check_thinking(cfg.orchestrator.train.sampling, "orchestrator.train.sampling")
            if cfg.orchestrator.eval is not None:
                prime_names.check_thinking(cfg.orchestrator.eval.sampling, "orchestrator.eval.sampling")
        elif isinstance(cfg, SFTConfig):
            validate_sft(cfg)
            prime_names.check_thinking(cfg.data, "data")
        if checks is not None and isinstance(cfg, (Config, SFTConfig)):
            notes.extend(checks(cfg))
    except ConfigError as e:
        # Name the field as the user wrote it too: `orchestrator.batch_size (hosted: batch_size)`.
        alias = hosted.hosted_path(e.path) if any_hosted else None
        if alias and alias != e.path:
            raise ConfigError(e.path, f"{e.message} [hosted field: {alias}]") from None
        raise
    return Loaded(cfg, notes, files)


def _load_env_files(cfg: Config) -> None:
    """Every process that loads a config loads its env_files into its own environment (launcher,
    and each role wherever it runs), before validation resolves `${env:NAME}` references. Paths are
    made absolute so the per-process configs work from any directory."""
    from hpcrl.config.secrets import load_env_files

    for i, p in enumerate(cfg.env_files):
        sanity.check_path_text(p, f"env_files[{i}]")
    cfg.env_files = [str(Path(p).expanduser().resolve()) for p in cfg.env_files]
    load_env_files(cfg.env_files)


def _role_log_extras(merged: dict[str, Any]) -> None:
    """A role's `wandb.log_extras` overrides [wandb.log_extras] field by field (as prime-rl's
    `--no-trainer.wandb.log-extras.distributions` turns off one thing of one role)."""
    for role in ("trainer", "orchestrator"):
        extras = get_path(merged, [role, "wandb", "log_extras"])
        if isinstance(extras, dict):
            base = get_path(merged, ["wandb", "log_extras"])
            set_path(
                merged,
                [role, "wandb", "log_extras"],
                deep_merge(base if isinstance(base, dict) else {}, extras),
            )


def _micro_batch_default(merged: dict[str, Any]) -> None:
    """An unset trainer.micro_batch_tokens grows to seq_len, so a long seq_len alone is valid."""
    seq_len = merged.get("seq_len")
    trainer = merged.get("trainer")
    explicit = isinstance(trainer, dict) and "micro_batch_tokens" in trainer
    if isinstance(seq_len, int) and not explicit and seq_len > TrainerConfig().micro_batch_tokens:
        merged.setdefault("trainer", {})["micro_batch_tokens"] = seq_len


def _drop_nones(d: dict[str, Any]) -> None:
    for k in [k for k, v in d.items() if v is None]:
        del d[k]
    for v in d.values():
        if isinstance(v, dict):
            _drop_nones(v)
