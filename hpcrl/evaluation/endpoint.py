"""Where `hpcrl eval` / `hpcrl gepa` send requests: a given OpenAI-compatible endpoint, or
`hpcrl inference` processes started here (the launcher's own spawning, logs and shutdown) and
stopped when the command ends.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from hpcrl.config.schema import ClientConfig, EvalInferenceConfig
from hpcrl.errors import ConfigError
from hpcrl.launch.local import Child, spawn, stop_children
from hpcrl.net import free_port
from hpcrl.paths import EvalPaths

log = logging.getLogger("hpcrl.evaluation")


class ServerDied(RuntimeError):
    """A self-started inference server exited or never became healthy."""


class Endpoints:
    """Context manager: `url(model)` is the base URL serving `model` (started on first use)."""

    def __init__(
        self,
        paths: EvalPaths,
        client: ClientConfig,
        inference: EvalInferenceConfig,
        seq_len: int,
        log_level: str | None = None,
    ):
        self.paths, self.client, self.inference, self.seq_len = paths, client, inference, seq_len
        self.log_level = log_level
        self.children: list[Child] = []
        self.served: dict[str, str] = {}

    def __enter__(self) -> Endpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        stop_children(self.children)
        self.children.clear()

    def api_key(self) -> str | None:
        return os.environ.get(self.client.api_key_var) if self.client.base_url else None

    def url(self, model: str) -> str:
        if self.client.base_url:
            return self.client.base_url
        return self.start(model)

    def start(self, model: str) -> str:
        """Serve `model` with `hpcrl inference` on a free port; block until /health answers."""
        if model in self.served:
            return self.served[model]
        inf = self.inference
        port = free_port()
        args = [
            "--model.name",
            model,
            "--server.host",
            "127.0.0.1",
            "--server.port",
            str(port),
            "--inference.backend",
            inf.backend,
            "--model.dtype",
            inf.dtype,
            "--inference.max-batch-size",
            str(inf.max_batch_size),
            "--inference.max-model-len",
            str(inf.max_model_len or self.seq_len),
            "--inference.gpu-memory-utilization",
            str(inf.gpu_memory_utilization),
            "--inference.parallel.tp",
            str(inf.tp),
            "--seq-len",
            str(self.seq_len),
        ]
        if inf.trust_remote_code:
            args.append("--model.trust-remote-code")
        if self.log_level:
            args += ["--log.level", self.log_level]
        index = len(self.children)
        role = "inference" if index == 0 else f"inference_{index}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        child = spawn("inference", role, args, self.paths.log_file(role), env)
        self.children.append(child)
        url = f"http://127.0.0.1:{port}"
        log.info("serving %s at %s (log: %s)", model, url, child.log_path)
        try:
            wait_healthy(child, url, self.client.server_timeout_s)
        except ServerDied as e:
            last = next((ln for ln in reversed(_tail(child).splitlines()) if ln.strip()), "")
            raise ConfigError(
                "model",
                f"`hpcrl inference` could not serve {model!r}: {e}; last log line: "
                f"{last[:300]} (log: {child.log_path})",
            ) from None
        self.served[model] = url
        return url


def wait_healthy(child: Child, url: str, timeout: float, interval: float = 0.25) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rc = child.proc.poll()
        if rc is not None:
            raise ServerDied(f"it exited with code {rc}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(interval)
    raise ServerDied(f"{url} not healthy after {timeout:.0f}s")


def _tail(child: Child, chars: int = 2000) -> str:
    try:
        return child.log_path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def load_tokenizer(model: str, client: ClientConfig, trust_remote_code: bool) -> Any:
    """The tokenizer rollouts use for prompt lengths and exact multi-turn stitching."""
    from hpcrl.models.resolve import resolve_model
    from hpcrl.models.tokenizer import load_tokenizer as load

    name = client.tokenizer or model
    try:
        return load(resolve_model(name), trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - any loading failure is the same user error
        field = "client.tokenizer" if client.tokenizer else "model"
        raise ConfigError(
            field,
            f"cannot load a tokenizer from {name!r} ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); give --client.tokenizer DIR",
        ) from None
