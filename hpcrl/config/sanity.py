"""Checks every config value gets regardless of its field: nesting depth, finite floats, usable paths.

msgspec enforces each field's type and range, but happily accepts NaN/inf for a float and recurses
without bound into nested data; these walks close that gap once, for every field of every schema.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import msgspec

from hpcrl.config.errors import ConfigError

MAX_DEPTH = 32  # deeper than any real config (the schema nests 5 levels; env args a few more)
_NAME_MAX = 255  # bytes per path component on every Linux filesystem we run on
_PSEUDO_FS = ("/proc", "/sys", "/dev")


def check_depth(value: Any, where: str, limit: int = MAX_DEPTH) -> None:
    """Raise ConfigError when tables/lists nest deeper than `limit` (iterative: no RecursionError)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            raise ConfigError(where, f"nested more than {limit} levels deep (tables/lists inside each other)")
        if isinstance(v, dict):
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)


def check_finite(obj: Any, path: str = "") -> None:
    """Every float anywhere in a converted config (fields, lists, env args) must be finite."""
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise ConfigError(path or "config", f"must be a finite number, got {obj!r}")
    elif isinstance(obj, msgspec.Struct):
        for name in obj.__struct_fields__:
            check_finite(getattr(obj, name), f"{path}.{name}" if path else name)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            check_finite(v, f"{path}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            check_finite(v, f"{path}[{i}]")


def check_output_dir(raw: str, field: str = "output_dir") -> None:
    """A run directory we can create: no NUL, components within NAME_MAX, not in a pseudo-filesystem,
    and every existing ancestor a directory (a file as parent would fail deep inside mkdir)."""
    if not raw.strip():
        raise ConfigError(field, "is empty (give a directory path)")
    if "\x00" in raw:
        raise ConfigError(field, "contains a NUL byte")
    try:
        encoded = os.fsencode(raw)
    except UnicodeEncodeError:
        raise ConfigError(field, "is not encodable as a file name (lone surrogate?)") from None
    for part in encoded.split(b"/"):
        if len(part) > _NAME_MAX:
            raise ConfigError(field, f"has a path component of {len(part)} bytes (at most {_NAME_MAX})")
    path = Path(os.path.abspath(raw))
    for fs in _PSEUDO_FS:
        if path == Path(fs) or Path(fs) in path.parents:
            raise ConfigError(
                field, f"'{raw}' is inside {fs}, a kernel pseudo-filesystem, not a place for a run"
            )
    for parent in [path, *path.parents]:
        try:
            if parent.exists():
                if not parent.is_dir():
                    what = (
                        "exists and is not a directory"
                        if parent == path
                        else f"has a parent '{parent}' that is a file"
                    )
                    raise ConfigError(field, f"'{raw}' {what}")
                return
        except OSError as e:
            raise ConfigError(field, f"'{raw}' cannot be inspected ({e.strerror})") from None


def check_shapes(d: Any, root: type[msgspec.Struct], path: str = "") -> None:
    """Every section the schema defines must be a table (and a list of sections a list of tables)
    before anything is derived from the merged dict: `trainer = 5` next to `seq_len` must be a
    one-line error naming `trainer`, not a TypeError in a default derived from `trainer`."""
    from hpcrl.config import fields

    if not isinstance(d, dict):
        return
    for key, value in d.items():
        here = f"{path}.{key}" if path else str(key)
        try:
            leaf = fields.resolve(root, here.split("."))
        except ConfigError:
            continue  # unknown keys are named by the conversion (with a suggestion)
        if leaf.kind == "section":
            if not isinstance(value, dict):
                raise ConfigError(here, f"must be a table ([{here}]), got {_shape(value)}")
            check_shapes(value, root, here)
        elif fields.is_section_list(root, here.split(".")):
            if not isinstance(value, list):
                raise ConfigError(here, f"must be a list of tables ([[{here}]]), got {_shape(value)}")
            for i, v in enumerate(value):
                if not isinstance(v, dict):
                    raise ConfigError(f"{here}[{i}]", f"must be a table, got {_shape(v)}")


def _shape(value: Any) -> str:
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}
    return f"{kinds.get(type(value), type(value).__name__)} ({value!r})"[:120]
