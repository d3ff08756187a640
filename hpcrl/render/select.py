"""Which renderer a run uses: `[orchestrator.renderer]` (RL, eval, GEPA) or `[renderer]` (SFT).

prime-rl's names: `name = "auto"` (default) looks the configured model id up in the package's exact
model-id map (`renderers.base.MODEL_RENDERER_MAP`: "Qwen/Qwen3-8B" -> "qwen3"); a model it does not
list (a local directory, a fine-tune, hpcrl's tiny models) falls back to "default" with a note, as
prime-rl does. "default" is the tokenizer's own chat template; any other renderer the package ships
("qwen3", "qwen3.5", "glm-5", "gpt-oss", ...) is accepted by name; "custom" loads `import_path`.
The model id is used rather than the tokenizer's `name_or_path`, which for a downloaded model is a
cache path that the map never lists.

`check` is what --dry-run runs: an unknown name, a custom renderer without `import_path`, a
`thinking_retention` the renderer refuses, or a renderer whose special tokens the tokenizer lacks
is one ConfigError naming the field.
"""

from __future__ import annotations

import functools
import typing
from collections.abc import Callable, Mapping
from typing import Any

from hpcrl.errors import ConfigError, nearest

INSTALL = "pip install 'renderers>=0.1.12'"
DEFAULT = "default"


def require_renderers(field: str) -> Any:
    """The `renderers` module, or a one-line ConfigError naming the install command."""
    try:
        import renderers
    except ImportError:
        raise ConfigError(
            field, f"needs the `renderers` package (Python >= 3.11), which is not installed: {INSTALL}"
        ) from None
    return renderers


@functools.cache
def known_names() -> tuple[str, ...]:
    """Every renderer name the installed package accepts (its config union's discriminators)."""
    renderers = require_renderers("renderer.name")
    union = typing.get_args(renderers.RendererConfig)[0]
    return tuple(
        sorted(typing.get_args(c.model_fields["name"].annotation)[0] for c in typing.get_args(union))
    )


def resolve_name(name: str, model_name: str) -> tuple[str, str | None]:
    """(concrete renderer name, a note for the log or None). Pure apart from the package's map."""
    if name != "auto":
        return name, None
    if not outside_the_map(model_name):
        from renderers.base import MODEL_RENDERER_MAP

        found = MODEL_RENDERER_MAP.get(model_name)
        if found is not None:
            return found, None
    return DEFAULT, (
        f"renderer auto: {model_name!r} is not in the renderers package's model map; using the tokenizer's "
        "own chat template (default). Set renderer.name (e.g. qwen3) for a typed renderer"
    )


def outside_the_map(model_name: str) -> bool:
    """Whether the package's model map (Hub ids: "Qwen/Qwen3-8B") cannot list ``model_name``, so that
    ``auto`` resolves to default without importing the package (which imports openai: ~1.3 s of CPU
    in every orchestrator, eval, SFT and dry run): hpcrl's built-in names, and paths that no Hub id
    can be (absolute, ./ ../ ~, more than one "/")."""
    from hpcrl.models.names import BUILTIN_MODELS

    return (
        not model_name
        or model_name in BUILTIN_MODELS
        or model_name.startswith(("/", "./", "../", "~"))
        or model_name.count("/") > 1
    )


def auto_fallback(cfg: Any, model_name: str, field: str) -> str | None:
    """auto's note when it falls back to default for a model outside the map (the fields checked as
    :func:`renderer_config` checks them), without importing the package; None when it may not.
    Without the package installed, None too: the callers' own not-installed path says so."""
    import importlib.util

    if cfg.name != "auto" or not outside_the_map(model_name) or importlib.util.find_spec("renderers") is None:
        return None
    _check_import_path(cfg, field)
    name, note = resolve_name(cfg.name, model_name)
    _check_retention(cfg, name, field)
    return note


def _check_import_path(cfg: Any, field: str) -> None:
    if (cfg.name == "custom") != (cfg.import_path is not None):
        raise ConfigError(
            f"{field}.import_path",
            "is required with name = 'custom' (a 'module.Class' or 'path/file.py:Class')"
            if cfg.name == "custom"
            else f"only applies to name = 'custom' (name is {cfg.name!r})",
        )


def _check_retention(cfg: Any, resolved: str, field: str) -> None:
    if resolved == DEFAULT and cfg.thinking_retention is not None:
        raise ConfigError(
            f"{field}.thinking_retention",
            "the default renderer (the tokenizer's template) cannot keep reasoning across turns; "
            "choose a typed renderer (e.g. qwen3) or leave it unset",
        )


# hpcrl's renderer fields that are the renderers package's own config fields, passed on as set
_PASSED = (
    "thinking_retention",
    "reasoning_parser",
    "tool_parser",
    "clear_thinking",
    "truncate_history_thinking",
)


def renderer_config(cfg: Any, model_name: str, field: str) -> tuple[Any, str | None]:
    """The renderers config object for `cfg` (hpcrl's RendererConfig section), and the auto note."""
    require_renderers(f"{field}.name")
    if cfg.name not in known_names():
        raise ConfigError(
            f"{field}.name",
            f"unknown renderer {cfg.name!r}{nearest(cfg.name, known_names())}; allowed: auto, default, custom "
            "or one the renderers package ships "
            f"({', '.join(n for n in known_names() if n not in ('auto', 'default', 'custom'))})",
        )
    _check_import_path(cfg, field)
    name, note = resolve_name(cfg.name, model_name)
    _check_retention(cfg, name, field)
    from renderers.configs import config_from_name

    kwargs = {k: getattr(cfg, k) for k in _PASSED if getattr(cfg, k, None) is not None}
    try:
        if name == "custom":
            from renderers.configs import CustomRendererConfig

            return CustomRendererConfig(import_path=cfg.import_path, **kwargs), note
        base = config_from_name(name)
        for k in kwargs:
            if k not in type(base).model_fields:
                raise ConfigError(f"{field}.{k}", f"renderer {name!r} has no {k} (leave it unset for it)")
        return (type(base).model_validate({**base.model_dump(), **kwargs}) if kwargs else base), note
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - pydantic / import errors: the user's config
        which = "import_path" if name == "custom" else "name"
        raise ConfigError(f"{field}.{which}", f"{type(e).__name__}: {str(e).splitlines()[0]}") from None


def create(tokenizer: Any, cfg: Any, model_name: str, field: str) -> tuple[Any, str | None]:
    """A Renderer on `tokenizer`; a renderer whose special tokens the tokenizer lacks is a ConfigError."""
    config, note = renderer_config(cfg, model_name, field)
    from renderers import create_renderer

    try:
        return create_renderer(tokenizer, config), note
    except (AssertionError, KeyError, ValueError, TypeError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            f"{field}.name",
            f"renderer {config.name!r} does not fit the tokenizer of {model_name!r}: {msg}",
        ) from None


def is_default(renderer: Any) -> bool:
    from renderers import DefaultRenderer

    return isinstance(renderer, DefaultRenderer)


def check(cfg: Any, model_name: str, field: str, load_tokenizer: Callable[[], Any] | None) -> str | None:
    """--dry-run: the config resolves and, when the tokenizer is at hand, a typed renderer builds on it."""
    config, note = renderer_config(cfg, model_name, field)
    if load_tokenizer is None or config.name == DEFAULT:
        return note
    return create(load_tokenizer(), cfg, model_name, field)[1]


def local_tokenizer_loader(model_name: str) -> Callable[[], Any] | None:
    """A loader for the tokenizer when it is on this machine (a directory, a built-in name), else None:
    --dry-run never downloads."""
    import os

    from hpcrl.models.names import BUILTIN_MODELS

    if not (os.path.isdir(model_name) or model_name in BUILTIN_MODELS):
        return None

    def load() -> Any:
        if model_name in BUILTIN_MODELS:  # its tokenizer alone (no weights to build for a dry run)
            from hpcrl.models.tiny import build_tokenizer

            return build_tokenizer(BUILTIN_MODELS[model_name].partition(":")[2] or "chatml")
        from hpcrl.models.tokenizer import load_tokenizer

        return load_tokenizer(model_name)

    return load


def dry_run_check(cfg: Any) -> list[str]:
    """--dry-run of `hpcrl run` / `hpcrl sft`: a typed renderer must build on the model's tokenizer
    (its special tokens present). Returns the notes to print (auto's fallback)."""
    section, field = (
        (cfg.orchestrator.renderer, "orchestrator.renderer")
        if hasattr(cfg, "orchestrator")
        else (cfg.renderer, "renderer")
    )
    model = cfg.model.name or ""
    if section.name == DEFAULT:
        return []
    if (note := auto_fallback(section, model, field)) is not None:
        return [note]
    try:
        import renderers  # noqa: F401
    except ImportError:
        if section.name == "auto":
            return [
                f"{field}: auto uses the default renderer (the renderers package is not installed: {INSTALL})"
            ]
        require_renderers(f"{field}.name")
    note = check(section, model, field, local_tokenizer_loader(model))
    return [note] if note else []


def typed_renderers(tokenizer: Any, section: Any, model_name: str, field: str) -> Any:
    """Renderers (below) when `section` resolves to a typed renderer, else None: the
    tokenizer's own template (also `auto` without the package installed). Logs auto's note."""
    import logging

    log = logging.getLogger("hpcrl.render")
    if section.name == DEFAULT:
        return None
    if (note := auto_fallback(section, model_name, field)) is not None:
        log.info(note)
        return None
    try:
        import renderers  # noqa: F401
    except ImportError:
        if section.name == "auto":
            return None
        require_renderers(f"{field}.name")
    renderer, note = create(tokenizer, section, model_name, field)
    if note:
        log.info(note)
    if is_default(renderer):
        return None
    log.info(
        "renderer %s (%s): turns bridged, sampled via /inference/v1/generate", type(renderer).__name__, field
    )
    return Renderers(tokenizer, renderer_config(section, model_name, field)[0])


class Renderers:
    """One renderer per set of chat-template switches (sampling's chat_template_kwargs, e.g.
    enable_thinking), built on first use from the run's renderer config."""

    def __init__(self, tokenizer: Any, config: Any):
        self.tokenizer, self.config = tokenizer, config
        self._by_kwargs: dict[tuple[tuple[str, Any], ...], Any] = {}

    def get(self, template_kwargs: Mapping[str, Any] | None) -> Any:
        key = tuple(sorted((template_kwargs or {}).items()))
        if key not in self._by_kwargs:
            from renderers import create_renderer

            self._by_kwargs[key] = create_renderer(
                self.tokenizer, self.config, chat_template_kwargs=dict(key) or None
            )
        return self._by_kwargs[key]
