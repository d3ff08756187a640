"""What a request points at on disk, and the numbers read from it: every failure is a client error.

Admin routes take paths (/update_weights `path`, /load_lora_adapter `lora_path`). Anything that stops
the server from resolving, opening or reading what they name (a name too long, a symlink loop, a
dangling link, a directory where a file belongs, a FIFO that would block the reader forever, a file
even root may not read) is answered 400 naming the field, the path and the reason; so is a number in
such a file (adapter_config.json's `r` / `lora_alpha`) that is not finite, in range, or of its kind.
Both backends read through here before anything is replaced, so a refused request leaves the loaded
weights and adapters as they were. Pure functions + APIError (no torch, no HTTP framework).
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from hpcrl.inference.protocol import APIError

MAX_LORA_RANK = 1 << 16  # no PEFT adapter is this wide; a larger `r` is a corrupt config
MAX_LORA_ALPHA = 1e6  # scale = alpha / r: larger turns a small adapter into inf weights
_SHOWN = 160  # characters of a path quoted in an answer (a 100 kB name is not echoed back whole)


def show(path: str | os.PathLike[str]) -> str:
    s = os.fspath(path)
    return repr(s if len(s) <= _SHOWN else f"{s[: _SHOWN // 2]}...{s[-_SHOWN // 2 :]} ({len(s)} chars)")


def _reason(e: OSError) -> str:
    if e.errno == errno.ELOOP:
        return "it is a symlink loop"
    if e.errno == errno.ENAMETOOLONG:
        return "the name is too long"
    if e.errno == errno.ENOENT:
        return "it does not exist (or is a dangling symlink)"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    return e.strerror or type(e).__name__


def fail(param: str, path: str | os.PathLike[str], why: str) -> APIError:
    return APIError(f"`{param}` {show(path)}: {why}; refused (nothing was loaded)", param=param)


def resolve(raw: str | os.PathLike[str], param: str) -> Path:
    """`raw` with every symlink followed; 400 naming `param` when it cannot be (too long, loop,
    dangling, missing, a component not searchable)."""
    try:
        return Path(os.path.realpath(raw, strict=True))
    except OSError as e:
        raise fail(param, raw, _reason(e)) from None
    except ValueError as e:  # embedded NUL
        raise fail(param, raw, str(e)) from None


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def regular_file(path: str | os.PathLike[str], param: str) -> Path:
    """A regular file (symlinks followed): never open a FIFO or device, whose read may block forever."""
    p = resolve(path, param)
    mode = _stat(p, param)
    if not stat.S_ISREG(mode):
        raise fail(param, path, f"it is {_kind(mode)}, not a regular file")
    try:  # readable at all? (mode bits lie for root; /proc and some mounts refuse even root)
        with open(p, "rb"):
            pass
    except OSError as e:
        raise fail(param, path, f"cannot be read: {_reason(e)}") from None
    return p


def directory(path: str | os.PathLike[str], param: str) -> Path:
    p = resolve(path, param)
    mode = _stat(p, param)
    if not stat.S_ISDIR(mode):
        raise fail(
            param, path, f"it is {_kind(mode) if not stat.S_ISREG(mode) else 'a file'}, not a directory"
        )
    return p


def _stat(p: Path, param: str) -> int:
    try:
        return os.stat(p).st_mode
    except OSError as e:
        raise fail(param, p, _reason(e)) from None


def read_text(path: str | os.PathLike[str], param: str) -> str:
    p = regular_file(path, param)
    try:
        return p.read_text(encoding="utf-8")
    except OSError as e:
        raise fail(param, path, f"cannot be read: {_reason(e)}") from None
    except UnicodeDecodeError as e:
        raise fail(param, path, f"is not UTF-8 text: {e}") from None


def read_json_object(path: str | os.PathLike[str], param: str) -> dict[str, Any]:
    try:
        obj = json.loads(read_text(path, param))
    except (ValueError, RecursionError) as e:
        raise fail(param, path, f"is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise fail(param, path, "is not a JSON object")
    return obj


def number(
    obj: dict[str, Any],
    key: str,
    where: str,
    param: str,
    *,
    integer: bool,
    lo: float,
    hi: float,
    lo_open: bool = False,
    default: float | None = None,
) -> float:
    """obj[key] as a finite number in [lo, hi] ((lo, hi] with lo_open), an integer when asked; 400
    naming the file and the field otherwise (inf, NaN, negative, huge, a bool or a string)."""
    v = obj.get(key, default)
    field = f"{where}: `{key}`"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise APIError(f"{field} must be a number, got {v!r}", param=param)
    if isinstance(v, float) and not math.isfinite(v):
        raise APIError(f"{field} must be finite, got {v!r}", param=param)
    if integer and not (isinstance(v, int) or v.is_integer()):
        raise APIError(f"{field} must be an integer, got {v!r}", param=param)
    if v < lo or v > hi or (lo_open and v == lo):
        low = f"> {lo:g}" if lo_open else f">= {lo:g}"
        raise APIError(f"{field} must be {low} and <= {hi:g}, got {v!r}", param=param)
    return int(v) if integer else float(v)


def adapter_numbers(cfg: dict[str, Any], where: str, param: str = "lora_path") -> tuple[int, float, bool]:
    """(r, lora_alpha, use_rslora) of a PEFT adapter config, each checked."""
    r = int(number(cfg, "r", where, param, integer=True, lo=1, hi=MAX_LORA_RANK))
    alpha = number(
        cfg, "lora_alpha", where, param, integer=False, lo=0, hi=MAX_LORA_ALPHA, lo_open=True, default=r
    )
    rslora = cfg.get("use_rslora", False)
    if rslora is not None and not isinstance(rslora, bool):
        raise APIError(f"{where}: `use_rslora` must be true or false, got {rslora!r}", param=param)
    return r, alpha, bool(rslora)
