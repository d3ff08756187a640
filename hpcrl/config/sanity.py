"""Checks every config value gets regardless of its field: nesting depth, finite floats, usable paths.

msgspec enforces each field's type and range, but happily accepts NaN/inf for a float and recurses
without bound into nested data; these walks close that gap once, for every field of every schema.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import msgspec

from hpcrl.errors import ConfigError, show_key

MAX_DEPTH = 32  # deeper than any real config (the schema nests 5 levels; env args a few more)
_NAME_MAX = 255  # bytes per path component on every Linux filesystem we run on
_PSEUDO_FS = ("/proc", "/sys", "/dev")


def check_depth(value: Any, where: str, limit: int = MAX_DEPTH, source: str | None = None) -> None:
    """Raise ConfigError when tables/lists nest deeper than `limit` (iterative: no RecursionError).
    The error names the path to the over-deep value under `where` (a field path, '' for a whole
    config); `source` (a file) is named in the message."""
    stack: list[tuple[Any, int, str]] = [(value, 0, where)]
    while stack:
        v, depth, path = stack.pop()
        if depth > limit:
            parts = re.findall(r"[^.\[]+|\[\d+\]", path)
            shown = "".join(p if p.startswith("[") or i == 0 else "." + p for i, p in enumerate(parts[:8]))
            shown += "…" if len(parts) > 8 else ""
            place = f" in {source}" if source else ""
            raise ConfigError(
                shown or "config",
                f"nested more than {limit} levels deep{place} (tables/lists inside each other)",
            )
        if isinstance(v, dict):
            stack.extend((x, depth + 1, _join(path, k)) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((x, depth + 1, f"{path}[{i}]") for i, x in enumerate(v))


def _join(path: str, key: Any) -> str:
    k = show_key(str(key))
    return f"{path}.{k}" if path else k


def check_text(value: Any, path: str = "") -> None:
    """Every string (and key) in a merged config must be text a file, a process and a log can carry:
    no NUL byte (no path, argument or environment variable can hold one) and no lone surrogate (an
    undecodable byte on the command line, which no UTF-8 config file can hold). Iterative."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        v, here = stack.pop()
        if isinstance(v, str):
            _check_str(v, here)
        elif isinstance(v, dict):
            for k, x in v.items():
                sub = _join(here, k)
                if isinstance(k, str):
                    _check_str(k, sub)
                stack.append((x, sub))
        elif isinstance(v, list):
            stack.extend((x, f"{here}[{i}]") for i, x in enumerate(v))


def _check_str(s: str, path: str) -> None:
    if "\x00" in s:
        raise ConfigError(path or "config", "contains a NUL byte (\\x00); not allowed in any config text")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(
            path or "config",
            "is not valid UTF-8 text (an undecodable byte on the command line?); give it as UTF-8",
        ) from None


def check_path_text(raw: str, field: str) -> None:
    """A path the OS can look up: no NUL, encodable, every component within NAME_MAX bytes, a
    `~user` that exists (else stat/mkdir/expanduser fail with an OSError or RuntimeError deep inside
    whatever touches it first)."""
    if "\x00" in raw:
        raise ConfigError(field, "contains a NUL byte")
    try:
        encoded = os.fsencode(raw)
    except UnicodeEncodeError:
        raise ConfigError(field, "is not encodable as a file name (lone surrogate?)") from None
    for part in encoded.split(b"/"):
        if len(part) > _NAME_MAX:
            raise ConfigError(field, f"has a path component of {len(part)} bytes (at most {_NAME_MAX})")
    if raw.startswith("~") and os.path.expanduser(raw) == raw:
        user = raw[1:].split("/", 1)[0]
        raise ConfigError(field, f"'{raw}': no home directory for user '{user}' (write the path out)")


# Integers go to C (torch, numpy, sockets, sleep, range): a value past 64 bits is no setting anyone
# means, and fails far from the config (OverflowError) or allocates without bound.
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1


def check_finite(obj: Any, path: str = "") -> None:
    """Every float anywhere in a converted config (fields, lists, env args) must be finite, and
    every integer must fit 64 bits (msgspec's conversion accepts any Python int)."""
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise ConfigError(path or "config", f"must be a finite number, got {obj!r}")
    elif isinstance(obj, int) and not isinstance(obj, bool):
        if not _INT_MIN <= obj <= _INT_MAX:
            raise ConfigError(
                path or "config", f"{obj} does not fit a 64-bit integer (allowed: -2^63 .. 2^63-1)"
            )
    elif isinstance(obj, msgspec.Struct):
        for name in obj.__struct_fields__:
            check_finite(getattr(obj, name), f"{path}.{name}" if path else name)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            check_finite(v, _join(path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            check_finite(v, f"{path}[{i}]")


def check_output_dir(raw: str, field: str = "output_dir") -> None:
    """A run directory we can create: no NUL, components within NAME_MAX, not in a pseudo-filesystem,
    and every existing ancestor a directory (a file as parent would fail deep inside mkdir)."""
    if not raw.strip():
        raise ConfigError(field, "is empty (give a directory path)")
    check_path_text(raw, field)
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
