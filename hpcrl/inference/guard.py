"""What every inference backend checks before a request does anything: auth, body shape, weight paths.

- Auth: the server's key (`--server.api-key`, or the run's key in $HPCRL_API_KEY that the launcher
  makes per run) guards every route but /health, as vLLM's --api-key does; a missing/wrong bearer token
  is 401. Admin routes (weights, LoRA, broadcaster, pause) are the ones that matter most.
- Bodies: JSON nesting is bounded and every string must be valid UTF-8 (a lone surrogate from a `\\ud800`
  escape would crash the tokenizer or the response encoder later), answered 400 naming the field.
- Weight paths: /update_weights and /load_lora_adapter read only under the run directory unless the
  operator allowed any path.
Pure functions + APIError; the backends (api.py, vllm_backend.py) call them.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from pathlib import Path
from typing import Any

from hpcrl.errors import ConfigError
from hpcrl.inference.files import show as files_show
from hpcrl.inference.protocol import APIError, show
from hpcrl.net import API_KEY_ENV

MAX_JSON_DEPTH = 64
ADMIN_ROUTES = (
    "/update_weights",
    "/init_broadcaster",
    "/load_lora_adapter",
    "/v1/load_lora_adapter",
    "/pause",
    "/resume",
)
OPEN_ROUTES = ("/health",)


def env_api_key() -> str | None:
    """The run's server key as the launcher hands it to every process (never a file, never a log)."""
    return os.environ.get(API_KEY_ENV) or None


def resolve_api_key(configured: str | None) -> str | None:
    """A role's key: `server.api_key` when given here, else the environment's. The per-process config
    files on disk hold it redacted, so a redacted value means "it came through the environment"."""
    from hpcrl.config.resolved import REDACTED

    return configured if configured and configured != REDACTED else env_api_key()


def export_run_api_key(configured: str | None) -> str:
    """Launchers: the run's key in this process's environment (inherited by every child and by srun),
    a fresh random token unless the user gave one. Returns it; never print or write it."""
    import secrets

    key = resolve_api_key(configured) or secrets.token_urlsafe(32)
    os.environ[API_KEY_ENV] = key
    return key


def check_auth(path: str, authorization: str | None, api_key: str | None) -> None:
    """401 unless the route is open, no key is configured, or `Authorization: Bearer <key>` matches."""
    if api_key is None or path in OPEN_ROUTES:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        what = "admin route" if path in ADMIN_ROUTES else "route"
        raise APIError(
            f"{path} is an authenticated {what}: send `Authorization: Bearer <server api key>`",
            status=401,
            type="AuthenticationError",
            param="authorization",
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, api_key: str | None, allow_open: bool) -> None:
    """A server reachable from other machines must have a key, unless the operator asked for an open one."""
    if api_key is None and not is_loopback(host) and not allow_open:
        raise ConfigError(
            "server.host",
            f"binding {host} (not loopback) without an API key would let anyone on "
            f"the network replace the policy; set --server.api-key KEY (or ${API_KEY_ENV}), "
            "or --server.allow-open true to serve without one",
        )


def check_body(body: Any) -> None:
    """Bounded nesting and valid UTF-8 everywhere (keys too); APIError naming the offending field."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        v, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(f"`{path}` nests more than {MAX_JSON_DEPTH} levels deep", param=_top(path))
        if isinstance(v, str):
            _utf8(v, path)
        elif isinstance(v, dict):
            for k, x in v.items():
                sub = f"{path}.{k}" if path else str(k)
                _utf8(str(k), sub)
                stack.append((x, sub, depth + 1))
        elif isinstance(v, list):
            stack.extend((x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v))


def check_host(host: Any) -> str:
    """A host name or address to dial: refuse what no resolver accepts before a thread blocks on it."""
    if (
        not isinstance(host, str)
        or not host
        or len(host) > 253
        or any(c.isspace() or ord(c) < 32 for c in host)
    ):
        raise APIError(f"`host` must be a host name or IP address, got {show(host)}", param="host")
    return host


def _top(path: str) -> str | None:
    return path.split(".")[0].split("[")[0] or None


def _utf8(s: str, path: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        where = path.encode("utf-8", "backslashreplace").decode() or "body"
        raise APIError(
            f"`{where}` is not valid UTF-8 (a lone surrogate escape such as \\ud800)", param=_top(where)
        ) from None


def check_weights_path(raw: str, run_dir: str | None, allow_any: bool, param: str = "path") -> None:
    """Weights may only come from inside the run directory (symlinks resolved) unless allowed."""
    if "\x00" in raw or not raw.strip():
        raise APIError(f"`{param}` must be a non-empty path without NUL bytes", param=param)
    if allow_any:
        return
    if run_dir is None:
        raise APIError(
            f"`{param}`: this server has no run directory, so it loads weights from no path "
            "(start it with --run-dir, or --server.allow-any-weights-path true)",
            status=403,
            type="PermissionError",
            param=param,
        )
    # Non-strict: a loop, a name too long or a missing file is the loader's 400 (hpcrl.inference.files);
    # here only containment is decided, and Path.resolve would raise on a loop (RuntimeError).
    root = Path(os.path.realpath(run_dir))
    target = Path(os.path.realpath(raw))
    if target != root and root not in target.parents:
        raise APIError(
            f"`{param}` {files_show(raw)} is outside the run directory {str(root)!r}; refused "
            "(--server.allow-any-weights-path true allows it)",
            status=403,
            type="PermissionError",
            param=param,
        )
