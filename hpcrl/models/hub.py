"""Hugging Face Hub ids, resolved through the local Hugging Face cache.

Every role (trainer, SFT, inference, the orchestrator's tokenizer, a teacher served by
``hpcrl inference``) turns ``model.name`` into a directory with ``hpcrl.models.tiny.resolve_model``,
which sends Hub ids here. ``huggingface_hub.snapshot_download`` does the work: with network it
downloads what is missing (weights, config, tokenizer; not the duplicate ``*.bin`` / ``original/``
files), with ``HF_HUB_OFFLINE=1`` it only reads the cache (``$HF_HUB_CACHE`` or
``$HF_HOME/hub``: ``models--org--name/snapshots/<rev>/`` + ``refs/main``).

``hpcrl submit`` calls ``prefetch_config`` on the submitting node (which has network) and runs the
job with ``HF_HUB_OFFLINE=1`` (``OFFLINE_ENV``): compute nodes never talk to the Hub, and a job
cannot start with a model that is not in the cache.
"""

from __future__ import annotations

import os
from typing import Any

from hpcrl.errors import ConfigError
from hpcrl.models.names import BUILTIN_MODELS

# What a causal LM directory needs (config, safetensors weights, tokenizer files, chat templates,
# remote code); the same checkpoint as PyTorch *.bin or in original/ format is not fetched.
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja", "*.py"]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1"}


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_hub(name: str, *, field: str = "model.name", cache_dir: str | None = None) -> str:
    """Local snapshot directory of Hub id ``name`` (``org/model`` or ``org/model@revision``),
    downloaded unless ``HF_HUB_OFFLINE=1``. Any failure is a one-line ``ConfigError`` naming ``field``."""
    repo_id, _, revision = name.partition("@")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError
    except ImportError as e:  # pragma: no cover - transformers depends on huggingface_hub
        raise ConfigError(field, f"{name!r} looks like a Hub id but huggingface_hub is not installed") from e
    try:
        path = snapshot_download(
            repo_id,
            revision=revision or None,
            cache_dir=cache_dir,
            allow_patterns=ALLOW_PATTERNS,
            local_files_only=offline(),
        )
    except HFValidationError:
        raise _invalid_id(name, field) from None
    except Exception as e:  # noqa: BLE001 - every hub failure (offline miss, 404, network) is a user error
        if offline():
            raise not_cached_offline(name, field, cache_dir) from None
        first = " ".join(str(e).split())[:200]
        raise ConfigError(
            field, f"cannot get {name!r} from the Hugging Face Hub: {type(e).__name__}: {first}"
        ) from None
    return str(path)


def _invalid_id(name: str, field: str) -> ConfigError:
    return ConfigError(
        field,
        f"{name!r} is neither a local directory, a built-in model "
        "(hpcrl/tiny-qwen3, hpcrl/small-qwen3) nor a valid Hub id (org/name)",
    )


def not_cached_offline(name: str, field: str, cache_dir: str | None = None) -> ConfigError:
    """What a Hub id outside the cache is under HF_HUB_OFFLINE=1: at start, and at --dry-run."""
    where = cache_dir or _cache_location()
    return ConfigError(
        field,
        f"{name!r} is not a local directory and not in the Hugging Face cache "
        f"{where} (HF_HUB_OFFLINE=1); download it first, e.g. "
        f"`huggingface-cli download {name.partition('@')[0]}`",
    )


def cached_snapshot(name: str, *, field: str = "model.name", cache_dir: str | None = None) -> str | None:
    """The snapshot directory ``resolve_hub`` would find for ``name`` in the local cache (one that holds
    config.json), or None when it is not there; reads the cache only, never the network (--dry-run).
    An invalid id is the same ConfigError as ``resolve_hub``'s."""
    repo_id, _, revision = name.partition("@")
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache_dir, revision=revision or None)
    except HFValidationError:
        raise _invalid_id(name, field) from None
    return os.path.dirname(found) if isinstance(found, str) else None


def _cache_location() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def hub_ids(cfg: Any) -> dict[str, str]:
    """``{field: Hub id}`` for every model name of an RL config that is neither a local directory nor
    a built-in tiny model (those need no download)."""
    out: dict[str, str] = {}
    fields = [("model.name", cfg.model)]
    for section in ("trainer", "orchestrator", "inference"):
        fields.append((f"{section}.model.name", getattr(getattr(cfg, section), "model", None)))
    for field, model in fields:
        name = getattr(model, "name", None)
        if name and not os.path.isdir(name) and name not in BUILTIN_MODELS:
            out[field] = name
    return out


def prefetch_config(cfg: Any) -> dict[str, str]:
    """Download every Hub id of ``cfg`` into the cache once (on the submitting node): ``{id: dir}``.
    The job then runs with ``OFFLINE_ENV``."""
    done: dict[str, str] = {}
    for field, name in hub_ids(cfg).items():
        if name not in done:
            done[name] = resolve_hub(name, field=field)
    return done


def job_env(cfg: Any, *, download: bool) -> dict[str, str]:
    """Environment of a SLURM job for ``cfg``: compute nodes read the submitting node's cache (pinned
    by path: it must be on a shared filesystem) and never reach the Hub. With ``download`` every Hub
    id is fetched into that cache first, so a missing model fails the submission, not the job."""
    if download:
        prefetch_config(cfg)
    return {**OFFLINE_ENV, "HF_HUB_CACHE": _cache_location()}


def seed_cache(
    model_dir: str | os.PathLike[str],
    repo_id: str,
    cache_dir: str | os.PathLike[str],
    revision: str = "0" * 40,
) -> str:
    """Place a local model directory in a Hugging Face cache as ``repo_id`` (the layout
    ``snapshot_download`` reads: ``models--org--name/snapshots/<revision>/`` + ``refs/main``), so the
    id resolves with ``HF_HUB_OFFLINE=1``: for air-gapped clusters, and for tests without network."""
    import shutil
    from pathlib import Path

    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    if snap.exists():
        shutil.rmtree(snap)
    shutil.copytree(model_dir, snap)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    return str(snap)
