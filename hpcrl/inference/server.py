"""`hpcrl inference`: serve the policy over HTTP with the embedded (hf) or the vLLM backend.

    serve(ServeOptions(model_name="hpcrl/tiny-qwen3", port=8000))      # blocks until SIGINT/SIGTERM
    python -m hpcrl.inference.server --model.name DIR --server.port 8000 [--inference.backend hf|vllm]

Once the server listens it writes its address file (RunPaths(run_dir).server_file(index)) so that the
orchestrator and trainer find it through the shared filesystem. This module imports nothing heavy at
import time: torch, transformers and vllm load inside `serve`.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("hpcrl.inference.server")


@dataclass
class ServeOptions:
    """Everything one inference server needs; the config system maps its `inference` section onto this."""

    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000  # 0: pick a free port (the address file says which)
    backend: str = "hf"  # "hf" (embedded transformers engine) | "vllm"
    max_batch_size: int = 64
    max_model_len: int = 2048
    dtype: str = "auto"
    seed: int = 0
    run_dir: str | None = None
    server_index: int = 0
    served_model_name: str | None = None  # name clients send as `model` (default: model_name)
    device: str | None = None  # hf backend: "cpu" / "cuda" (default: cuda when available)
    log_level: str = "warning"  # uvicorn access/error log level
    vllm_args: list[str] = field(default_factory=list)  # extra `vllm serve` flags (vllm backend only)
    api_key: str | None = None  # bearer token for every route but /health (guard.py); None: $HPCRL_API_KEY
    allow_open: bool = False  # serve a non-loopback address without a key
    allow_any_weights_path: bool = False  # weight/LoRA loads outside run_dir

    def validate(self) -> None:
        if self.backend not in ("hf", "vllm"):
            raise ValueError(f"inference.backend: {self.backend!r} is not allowed; use hf or vllm")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"server.port: {self.port} is outside 0..65535")
        if self.max_batch_size < 1:
            raise ValueError(f"inference.max_batch_size: must be >= 1, got {self.max_batch_size}")
        if self.max_model_len < 2:
            raise ValueError(f"inference.max_model_len: must be >= 2, got {self.max_model_len}")
        if self.api_key is not None and (not self.api_key.strip() or any(c.isspace() for c in self.api_key)):
            raise ValueError("server.api_key: must be a non-empty token without spaces")
        from hpcrl.inference.guard import check_exposure

        check_exposure(self.host, self.api_key, self.allow_open)


def advertised_host(host: str) -> str:
    """The host other nodes should dial: the machine's name when bound to every interface."""
    return socket.getfqdn() if host in ("0.0.0.0", "::", "") else host


def write_server_info(opts: ServeOptions, port: int) -> Path | None:
    """Write the ready file atomically (tmp + fsync + rename); the bus ServerInfo when it exists."""
    if not opts.run_dir:
        return None
    from hpcrl.paths import RunPaths

    host = advertised_host(opts.host)
    info = {"index": opts.server_index, "base_url": f"http://{host}:{port}", "host": host, "port": port,
            "pid": os.getpid(), "model": opts.served_model_name or opts.model_name}
    path = RunPaths(opts.run_dir).server_file(opts.server_index)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The bus owns the format (ServerInfo as JSON, what Bus.servers() reads).
    from hpcrl.bus.files import write_atomic
    from hpcrl.bus.messages import ServerInfo, encode_json

    write_atomic(path, [encode_json(ServerInfo(**info))])
    return path


def serve_config(cfg: Any, run_dir: str | None = None, server_index: int = 0) -> int:
    """`hpcrl inference`: map the typed config onto ServeOptions and serve (blocks)."""
    from hpcrl.inference.guard import resolve_api_key
    from hpcrl.models.tiny import resolve_model
    from hpcrl.monitor.logging import setup_logging

    setup_logging("inference", cfg.log.level)
    inf = cfg.inference
    backend = inf.backend
    if backend == "auto":
        backend = "vllm" if _has_cuda_and_vllm() else "hf"
    model = (inf.model.name if inf.model is not None and inf.model.name else None) or cfg.model.name
    opts = ServeOptions(
        model_name=resolve_model(model),
        served_model_name=model,
        host=cfg.server.host,
        port=cfg.server.port,
        backend=backend,
        # Deterministic mode: one sequence per forward, so logits never depend on which other requests
        # happen to share a decode batch (bitwise-reproducible logprobs across runs and resumes).
        max_batch_size=1 if cfg.deterministic else inf.max_batch_size,
        max_model_len=inf.max_model_len or cfg.seq_len,
        dtype=cfg.model.dtype,
        seed=inf.seed,
        run_dir=run_dir,
        server_index=server_index,
        api_key=resolve_api_key(cfg.server.api_key),
        allow_open=cfg.server.allow_open,
        allow_any_weights_path=cfg.server.allow_any_weights_path,
    )
    if backend == "vllm":
        opts.vllm_args = [f"--tensor-parallel-size={inf.parallel.tp}", f"--gpu-memory-utilization={inf.gpu_memory_utilization}"]
        if inf.enforce_eager:
            opts.vllm_args.append("--enforce-eager")
    try:
        opts.validate()
    except ValueError as e:
        from hpcrl.config.errors import ConfigError

        field, _, msg = str(e).partition(": ")
        raise ConfigError(field if msg else "inference", msg or str(e)) from None
    serve(opts)
    return 0


def _has_cuda_and_vllm() -> bool:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"server.port: cannot listen on {host}:{port}: {e.strerror}") from e
    sock.set_inheritable(True)
    return sock


def serve(opts: ServeOptions) -> None:
    """Load the model, listen, write the address file, serve until interrupted."""
    opts.validate()
    from hpcrl.models.tiny import resolve_model

    model_path = resolve_model(opts.model_name)
    if opts.api_key:  # both backends read the key from the environment (vLLM: VLLM_API_KEY guards /v1)
        from hpcrl.inference.guard import API_KEY_ENV

        os.environ[API_KEY_ENV] = os.environ["VLLM_API_KEY"] = opts.api_key
    if opts.backend == "vllm":
        from hpcrl.inference import vllm_backend

        vllm_backend.serve(opts, model_path)
        return
    _serve_hf(opts, model_path)


def _Server(config: Any) -> Any:
    """uvicorn's server, plus a hard exit deadline from the first SIGTERM/SIGINT: open keep-alive
    connections or a long generation must not hold the process past SLURM's KillWait."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            from hpcrl.monitor.watchdog import arm_exit_deadline

            arm_exit_deadline("inference")
            super().handle_exit(sig, frame)

    return Server(config)


def _serve_hf(opts: ServeOptions, model_path: str) -> None:
    import asyncio

    import uvicorn

    from hpcrl.inference.api import ServerState, build_app
    from hpcrl.inference.engine import HFEngine

    sock = _bind(opts.host, opts.port)  # fail fast on a taken port, before loading the model
    engine = HFEngine(model_path, max_batch_size=opts.max_batch_size, max_model_len=opts.max_model_len,
                      dtype=opts.dtype, seed=opts.seed, device=opts.device)
    state = ServerState(engine, opts.served_model_name or opts.model_name, model_path, api_key=opts.api_key,
                        run_dir=opts.run_dir, allow_any_weights_path=opts.allow_any_weights_path)
    app = build_app(state)
    config = uvicorn.Config(app, log_level=opts.log_level, access_log=False, timeout_keep_alive=30,
                            lifespan="off", timeout_graceful_shutdown=3)
    server = _Server(config)
    port = sock.getsockname()[1]

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.02)
        write_server_info(opts, port)
        print(f"hpcrl inference ready at http://{advertised_host(opts.host)}:{port} "
              f"(model {state.served_name}, backend hf, pid {os.getpid()})", flush=True)

    async def main() -> None:
        task = asyncio.create_task(announce())
        await server.serve(sockets=[sock])
        task.cancel()

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
        sock.close()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcrl inference", description="Serve the policy over an OpenAI-style HTTP API.")
    p.add_argument("--model.name", dest="model_name", required=True,
                   help="HF model dir, built-in name (hpcrl/tiny-qwen3) or hub id")
    p.add_argument("--server.host", dest="host", default="127.0.0.1", help="interface to listen on")
    p.add_argument("--server.port", dest="port", type=int, default=8000, help="port (0: any free port)")
    p.add_argument("--inference.backend", dest="backend", choices=["hf", "vllm"], default="hf",
                   help="hf: embedded transformers engine; vllm: vLLM's OpenAI server (GPU)")
    p.add_argument("--inference.max-batch-size", "--inference.max_batch_size", dest="max_batch_size", type=int,
                   default=64, help="most sequences decoded together")
    p.add_argument("--inference.max-model-len", "--inference.max_model_len", dest="max_model_len", type=int,
                   default=2048, help="context length (prompt + completion)")
    p.add_argument("--inference.dtype", dest="dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--inference.seed", dest="seed", type=int, default=0, help="seed of unseeded sampling")
    p.add_argument("--served-model-name", dest="served_model_name", default=None,
                   help="name clients pass as `model`")
    p.add_argument("--run-dir", dest="run_dir", default=None, help="run output dir: write the address file there")
    p.add_argument("--server-index", dest="server_index", type=int, default=0, help="this server's index")
    p.add_argument("--log-level", dest="log_level", default="warning", help="uvicorn log level")
    p.add_argument("--server.api-key", dest="api_key", default=None,
                   help="bearer token every route but /health requires (default $HPCRL_API_KEY)")
    p.add_argument("--server.allow-open", dest="allow_open", action="store_true",
                   help="serve a non-loopback address without an API key")
    p.add_argument("--server.allow-any-weights-path", dest="allow_any_weights_path", action="store_true",
                   help="let /update_weights and /load_lora_adapter read outside --run-dir")
    return p


def main(argv: list[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    kw: dict[str, Any] = vars(args)
    if extra and kw["backend"] != "vllm":
        print(f"error: unknown arguments {extra} (only the vllm backend passes extra flags on)", file=sys.stderr)
        return 2
    opts = ServeOptions(**kw, vllm_args=extra)
    if opts.api_key is None:
        from hpcrl.inference.guard import env_api_key

        opts.api_key = env_api_key()
    try:
        opts.validate()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("serving %s", asdict(opts))
    try:
        serve(opts)
    except KeyboardInterrupt:
        pass
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
