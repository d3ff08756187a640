"""Warm start (hosted `checkpoint_id`, native `ckpt.warm_start`): a new run begins from the weights
of another run's checkpoint, at step 0, with a fresh optimizer unless `ckpt.warm_start_optimizer`
asks for the source run's optimizer state too (`optimizer_source`; the trainer's Checkpointer loads it).

A checkpoint is named by its directory (`<run_dir>/checkpoints/step_N`), by its HF weights directory
(`<run_dir>/weights/step_N`, or any HF model dir), or by an id that `hpcrl checkpoints <run_dir>`
lists (`ckpt_<12 hex>`, stable for a given run directory and step). Listing records the ids in an
index in the hpcrl cache ($HPCRL_CACHE or ~/.cache/hpcrl/checkpoint_ids.json), so an id works from
any directory of this machine or cluster home. Weights are read from the HF `weights/step_N`
directory when the checkpoint has one; without it (ckpt.hf_weights) the trainer reads the checkpoint's
sharded state under HF names (hpcrl.trainer.export, what `hpcrl export` writes).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from hpcrl.errors import ConfigError
from hpcrl.fileio import write_text
from hpcrl.paths import RunPaths, parse_step_dir

ID_RE = re.compile(r"ckpt_[0-9a-f]{12}")
FIELD = "ckpt.warm_start"


@dataclass(frozen=True)
class Source:
    weights_dir: Path  # HF dir (config.json + *.safetensors), or a checkpoint step dir without one
    run_dir: Path | None  # the run it came from (None: a bare HF dir)
    step: int | None


@dataclass(frozen=True)
class Listed:
    id: str
    step: int
    complete: bool
    weights_dir: Path


def index_file() -> Path:
    return Path(os.environ.get("HPCRL_CACHE") or Path.home() / ".cache" / "hpcrl") / "checkpoint_ids.json"


def checkpoint_id(run_dir: Path, step: int) -> str:
    key = f"{Path(run_dir).resolve()}|{step}"
    return "ckpt_" + hashlib.blake2b(key.encode(), digest_size=6).hexdigest()


def list_checkpoints(run_dir: Path, register: bool = True) -> list[Listed]:
    """Every checkpoint step of a run (complete or not) and its id; complete ones are recorded in
    the index so their ids resolve later."""
    from hpcrl import checkpoint

    paths = RunPaths(run_dir)
    out = [
        Listed(
            checkpoint_id(paths.root, s),
            s,
            checkpoint.verify(paths, s, deep=False) is None,
            paths.weights_dir(s),
        )
        for s in checkpoint.list_steps(paths)
    ]
    if register:
        _record({c.id: str(paths.checkpoint_dir(c.step).resolve()) for c in out if c.complete})
    return out


def _record(entries: dict[str, str]) -> None:
    if not entries:
        return
    f = index_file()
    f.parent.mkdir(parents=True, exist_ok=True)
    known = _index()
    known.update(entries)
    write_text(f, json.dumps(known, indent=1, sort_keys=True))


def _index() -> dict[str, str]:
    try:
        return dict(json.loads(index_file().read_text()))
    except (OSError, ValueError):
        return {}


def resolve(ref: str) -> Source:
    """The weights a warm-start reference names; ConfigError (one line) when it names none."""
    ref = ref.strip()
    if ID_RE.fullmatch(ref):
        path = _index().get(ref)
        if path is None:
            raise ConfigError(
                FIELD, f"unknown checkpoint id '{ref}' (list a run's ids with `hpcrl checkpoints RUN_DIR`)"
            )
        ref = path
    d = Path(ref).expanduser().resolve()
    if not d.is_dir():
        raise ConfigError(
            FIELD,
            f"'{ref}' is neither a checkpoint (<run_dir>/checkpoints/step_N), a weights dir, "
            "nor a checkpoint id (`hpcrl checkpoints RUN_DIR` lists them)",
        )
    step = parse_step_dir(d.name)
    if step is not None and d.parent.name == "checkpoints":
        return _from_checkpoint(d.parent.parent, step, ref)
    if step is not None and d.parent.name == "weights" and (d.parent.parent / "configs").is_dir():
        return Source(_weights(d, ref), d.parent.parent, step)
    return Source(_weights(d, ref), None, None)


def _from_checkpoint(run_dir: Path, step: int, ref: str) -> Source:
    from hpcrl import checkpoint

    paths = RunPaths(run_dir)
    problem = checkpoint.verify(paths, step, deep=False)
    if problem is not None:
        raise ConfigError(FIELD, f"checkpoint '{ref}' is not complete: {problem}")
    w = paths.weights_dir(step)
    if not _has_weights(w) and (paths.trainer_ckpt_dir(step) / "hf" / "names.json").is_file():
        # no weights/step_N (ckpt.hf_weights): the trainer reads the sharded state under HF names
        return Source(paths.checkpoint_dir(step), paths.root, step)
    return Source(_weights(w, ref), paths.root, step)


def _has_weights(d: Path) -> bool:
    return (d / "config.json").is_file() and any(d.glob("*.safetensors"))


def _weights(d: Path, ref: str) -> Path:
    if not _has_weights(d):
        raise ConfigError(FIELD, f"'{ref}': {d} holds no HF weights (config.json + *.safetensors)")
    return d


def source_model(src: Source) -> str | None:
    """The model name the source run trained (from its resolved config), None for a bare dir."""
    if src.run_dir is None:
        return None
    try:
        cfg = tomllib.loads(RunPaths(src.run_dir).resolved_config.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    model = cfg.get("model")
    return model.get("name") if isinstance(model, dict) else None


_SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)


def check_same_model(src: Source, ref: str, model_name: str) -> None:
    """A warm start must come from a run of the same model: same name when the run is known, else the
    same architecture (config.json) as the model when that is a local dir."""
    trained = source_model(src)
    if trained is not None:
        if trained != model_name:
            raise ConfigError(
                FIELD,
                f"checkpoint '{ref}' was trained from model '{trained}', this run's model is "
                f"'{model_name}' (a warm start needs the same model)",
            )
        return
    local = Path(model_name, "config.json")
    if local.is_file():
        a = json.loads(local.read_text())
        b = json.loads((src.weights_dir / "config.json").read_text())
        diff = [k for k in _SHAPE_KEYS if a.get(k) != b.get(k)]
        if diff:
            raise ConfigError(
                FIELD,
                f"'{ref}' is a different model than '{model_name}' ({diff[0]}: "
                f"{b.get(diff[0])} vs {a.get(diff[0])}; a warm start needs the same model)",
            )


def resolve_for(ref: str, model_name: str) -> Path:
    """Validate a warm-start reference for a run of `model_name`; the HF weights dir to load."""
    src = resolve(ref)
    check_same_model(src, ref, model_name)
    return src.weights_dir


OPTIM_FIELD = "ckpt.warm_start_optimizer"


def optimizer_source(ref: str) -> tuple[RunPaths, int]:
    """The run and step whose trainer optimizer state `ckpt.warm_start_optimizer` carries over: the
    reference must name a run's complete checkpoint that kept its trainer part (a bare HF dir has no
    optimizer state). Works on the resolved reference too (`<run>/weights/step_N`), so every role
    finds the same checkpoint."""
    from hpcrl import checkpoint

    src = resolve(ref)
    if src.run_dir is None or src.step is None:
        raise ConfigError(
            OPTIM_FIELD,
            f"ckpt.warm_start '{ref}' is a bare weights dir without optimizer state; name a checkpoint "
            "(<run_dir>/checkpoints/step_N or an id from `hpcrl checkpoints RUN_DIR`) or set it to false",
        )
    paths = RunPaths(src.run_dir)
    problem = checkpoint.verify(paths, src.step, deep=False)
    if problem is not None:
        raise ConfigError(
            OPTIM_FIELD, f"checkpoint {paths.checkpoint_dir(src.step)} is not complete: {problem}"
        )
    if not (paths.trainer_ckpt_dir(src.step) / "rank_0.json").is_file():
        raise ConfigError(
            OPTIM_FIELD,
            f"checkpoint {paths.checkpoint_dir(src.step)} has no trainer optimizer state "
            "(written with ckpt.weights_only)",
        )
    return paths, src.step


def source_lora(paths: RunPaths) -> tuple[bool, dict[str, Any] | None]:
    """(known, the source run's LoRA table or None): the trainer's model section of its resolved
    config (RL copies the shared one there; SFT has only `model`). Not known without a config."""
    try:
        cfg = tomllib.loads(paths.resolved_config.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return False, None
    trainer = cfg.get("trainer")
    model = trainer.get("model") if isinstance(trainer, dict) else None
    if not isinstance(model, dict):
        model = cfg.get("model") if isinstance(cfg.get("model"), dict) else {}
    lora = model.get("lora")
    return True, lora if isinstance(lora, dict) else None


def check_same_adapter(paths: RunPaths, lora: dict[str, Any] | None) -> None:
    """Adapter moments only fit the same adapter: full vs LoRA, or another rank / target set, is
    refused (one line). The trainer checks tensor shapes again when it loads."""
    known, theirs = source_lora(paths)
    if not known:
        return

    def shape(t: dict[str, Any] | None) -> str:
        if t is None:
            return "full fine-tuning"
        return f"LoRA rank {t.get('rank')} on {sorted(t.get('target_modules') or [])}"

    if shape(theirs) != shape(lora):
        raise ConfigError(
            OPTIM_FIELD,
            f"the source run trained {shape(theirs)}, this run trains {shape(lora)}: its optimizer "
            "state does not apply (use the same adapter shape, or set it to false for a fresh optimizer)",
        )


def paths_of(run: Path, step: int) -> Path:
    return RunPaths(run).checkpoint_dir(step)


def main(argv: list[str]) -> int:
    """`hpcrl checkpoints RUN_DIR`: the run's checkpoints and their ids (usable as checkpoint_id)."""
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: hpcrl checkpoints RUN_DIR   (lists checkpoint ids for checkpoint_id / ckpt.warm_start)")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    run = Path(argv[0])
    if not RunPaths(run).checkpoints_dir.is_dir():
        raise ConfigError("RUN_DIR", f"{run} has no checkpoints/ directory")
    rows = list_checkpoints(run)
    model = source_model(Source(run, run, None)) or "?"
    print(f"run {RunPaths(run).root} (model {model})")
    print(f"{'id':<18} {'step':>6}  {'status':<10} weights")
    for c in rows:
        where = (
            c.weights_dir if _has_weights(c.weights_dir) else f"(none: hpcrl export {paths_of(run, c.step)})"
        )
        print(f"{c.id:<18} {c.step:>6}  {'ready' if c.complete else 'incomplete':<10} {where}")
    if not rows:
        print("(no checkpoints)")
    return 0
