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
import sys
from dataclasses import asdict
from typing import Any

from hpcrl.inference.options import ServeOptions, advertised_host, bind_server_socket, write_server_info

log = logging.getLogger("hpcrl.inference.server")


def serve_config(cfg: Any, run_dir: str | None = None, server_index: int = 0) -> int:
    """`hpcrl inference`: map the typed config onto ServeOptions and serve (blocks)."""
    from hpcrl import runtime
    from hpcrl.config.sections import environ
    from hpcrl.models.resolve import resolve_model
    from hpcrl.monitor.logging import setup_logging

    setup_logging("inference", cfg.log.level)
    runtime.apply_compute(cfg)
    runtime.bind_gpus()  # before CUDA starts; the record follows once the port is known
    opts = serve_options(cfg, run_dir, server_index)
    opts.model_name = resolve_model(opts.served_model_name or "", field="inference.model.name")
    # A standalone `hpcrl inference` gets the environment the launchers give a server (as prime-rl's
    # does): env_vars under inference.env_vars, before any backend library loads.
    os.environ.update(environ.resolved(cfg, "inference"))
    serve(opts)
    return 0


def serve_options(cfg: Any, run_dir: str | None = None, server_index: int = 0) -> ServeOptions:
    """The validated options `hpcrl inference` serves with (also its --dry-run's); ``model_name`` is
    still the configured name: `serve_config` resolves it to a directory."""
    from hpcrl.config.schema import InferenceModelConfig
    from hpcrl.inference import vllm_args
    from hpcrl.inference.guard import resolve_api_key

    inf = cfg.inference
    backend = inf.backend
    if backend == "auto":
        backend = "vllm" if _has_cuda_and_vllm() else "hf"
    # [model]'s name / dtype / trust_remote_code flowed in (hpcrl.config.loader.flow_models)
    mcfg = inf.model or InferenceModelConfig(name=cfg.model.name)
    model = mcfg.name or cfg.model.name
    opts = ServeOptions(
        model_name=model,
        served_model_name=model,
        host=cfg.server.host,
        port=cfg.server.port,
        backend=backend,
        # Deterministic mode: one sequence per forward, so logits never depend on which other requests
        # happen to share a decode batch (bitwise-reproducible logprobs across runs and resumes).
        max_batch_size=1 if cfg.deterministic else inf.max_batch_size,
        max_model_len=inf.max_model_len or cfg.seq_len,
        kv_cache_tokens=inf.kv_cache_tokens,
        dtype=mcfg.dtype,
        trust_remote_code=mcfg.trust_remote_code,
        seed=inf.seed,
        run_dir=run_dir,
        server_index=server_index,
        tp=inf.parallel.tp,
        lora_rank=mcfg.max_lora_rank,
        gpu_memory_utilization=inf.gpu_memory_utilization,
        enforce_eager=inf.enforce_eager,
        quantization=inf.quantization,
        delta_base=cfg.trainer.broadcast.delta,  # only a delta-syncing run needs the vLLM workers' host copy
        api_key=resolve_api_key(cfg.server.api_key),
        allow_open=cfg.server.allow_open,
        allow_any_weights_path=cfg.server.allow_any_weights_path,
        control_timeout_s=cfg.server.control_timeout_s,
        watchdog_s=cfg.watchdog_s,
        engine_args=vllm_args.engine_args(cfg) if backend == "vllm" else {},  # [inference.vllm] & co
        engine_env=vllm_args.engine_env(cfg) if backend == "vllm" else {},
    )
    opts.validate()  # a bad value is a ConfigError naming its field
    return opts


def _has_cuda_and_vllm() -> bool:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return False
    from hpcrl.runtime import use_cuda

    return use_cuda()


def serve(opts: ServeOptions) -> None:
    """Load the model, listen, write the address file, serve until interrupted."""
    opts.validate()
    from hpcrl.models.resolve import resolve_model

    model_path = resolve_model(opts.model_name)
    if opts.api_key:  # both backends read the key from the environment (vLLM: VLLM_API_KEY guards /v1)
        from hpcrl.net import API_KEY_ENV

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
    from hpcrl.inference.http_protocol import HalfCloseProtocol

    sock = bind_server_socket(opts.host, opts.port)  # fail fast on a taken port, before loading the model
    engine = HFEngine(
        model_path,
        max_batch_size=opts.max_batch_size,
        max_model_len=opts.max_model_len,
        dtype=opts.dtype,
        seed=opts.seed,
        device=opts.device,
        trust_remote_code=opts.trust_remote_code,
        quantization=opts.quantization,
        kv_cache_tokens=opts.kv_cache_tokens,
    )
    from hpcrl.monitor import watchdog

    watchdog.start(f"inference[{opts.server_index}]", opts.watchdog_s)  # the engine loop beats it
    state = ServerState(
        engine,
        opts.served_model_name or opts.model_name,
        model_path,
        api_key=opts.api_key,
        run_dir=opts.run_dir,
        allow_any_weights_path=opts.allow_any_weights_path,
        control_timeout_s=opts.control_timeout_s,
    )
    app = build_app(state)
    config = uvicorn.Config(
        app,
        http=HalfCloseProtocol,  # answers a client that half-closed after its request
        log_level=opts.log_level,
        access_log=False,
        timeout_keep_alive=30,
        lifespan="off",
        timeout_graceful_shutdown=3,
    )
    server = _Server(config)
    port = sock.getsockname()[1]

    async def announce() -> None:
        while not server.started:
            if server.should_exit:
                return
            await asyncio.sleep(0.02)
        write_server_info(opts, port)
        print(
            f"hpcrl inference ready at http://{advertised_host(opts.host)}:{port} "
            f"(model {state.served_name}, backend hf, pid {os.getpid()})",
            flush=True,
        )

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
    p = argparse.ArgumentParser(
        prog="hpcrl inference", description="Serve the policy over an OpenAI-style HTTP API."
    )
    p.add_argument(
        "--model.name",
        dest="model_name",
        required=True,
        help="HF model dir, built-in name (hpcrl/tiny-qwen3) or hub id",
    )
    p.add_argument("--server.host", dest="host", default="127.0.0.1", help="interface to listen on")
    p.add_argument("--server.port", dest="port", type=int, default=8000, help="port (0: any free port)")
    p.add_argument(
        "--inference.backend",
        dest="backend",
        choices=["hf", "vllm"],
        default="hf",
        help="hf: embedded transformers engine; vllm: vLLM's OpenAI server (GPU)",
    )
    p.add_argument(
        "--inference.max-batch-size",
        "--inference.max_batch_size",
        dest="max_batch_size",
        type=int,
        default=64,
        help="most sequences decoded together",
    )
    p.add_argument(
        "--inference.max-model-len",
        "--inference.max_model_len",
        dest="max_model_len",
        type=int,
        default=2048,
        help="context length (prompt + completion)",
    )
    p.add_argument(
        "--inference.kv-cache-tokens",
        "--inference.kv_cache_tokens",
        dest="kv_cache_tokens",
        type=int,
        default=None,
        help="hf engine: KV capacity in tokens (default: max_batch_size x max_model_len)",
    )
    p.add_argument(
        "--inference.dtype", dest="dtype", default="auto", help="auto | float32 | bfloat16 | float16"
    )
    p.add_argument("--inference.seed", dest="seed", type=int, default=0, help="seed of unseeded sampling")
    p.add_argument(
        "--inference.parallel.tp",
        dest="tp",
        type=int,
        default=1,
        help="vllm: tensor-parallel GPUs of this server",
    )
    p.add_argument(
        "--inference.model.max-lora-rank",
        dest="lora_rank",
        type=int,
        default=None,
        help="vllm: rank of the LoRA adapters this server will load (enables LoRA)",
    )
    p.add_argument(
        "--served-model-name", dest="served_model_name", default=None, help="name clients pass as `model`"
    )
    p.add_argument(
        "--run-dir", dest="run_dir", default=None, help="run output dir: write the address file there"
    )
    p.add_argument("--server-index", dest="server_index", type=int, default=0, help="this server's index")
    p.add_argument("--log-level", dest="log_level", default="warning", help="uvicorn log level")
    p.add_argument(
        "--server.api-key",
        dest="api_key",
        default=None,
        help="bearer token every route but /health requires (default $HPCRL_API_KEY)",
    )
    p.add_argument(
        "--server.allow-open",
        dest="allow_open",
        action="store_true",
        help="serve a non-loopback address without an API key",
    )
    p.add_argument(
        "--server.allow-any-weights-path",
        dest="allow_any_weights_path",
        action="store_true",
        help="let /update_weights and /load_lora_adapter read outside --run-dir",
    )
    p.add_argument(
        "--delta-base",
        dest="delta_base",
        action="store_true",
        help="vllm: keep the loaded weights as the base of delta syncs (tp x the policy in host memory)",
    )
    p.add_argument(
        "--server.control-timeout-s",
        dest="control_timeout_s",
        type=float,
        default=8.0,
        help="longest /init_broadcaster waits on its peer before answering 502/504",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    from hpcrl.errors import user_errors

    return user_errors(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    kw: dict[str, Any] = vars(args)
    if extra and kw["backend"] != "vllm":
        print(
            f"error: unknown arguments {extra} (only the vllm backend passes extra flags on)", file=sys.stderr
        )
        return 2
    opts = ServeOptions(**kw, vllm_args=extra)
    if opts.api_key is None:
        from hpcrl.inference.guard import env_api_key

        opts.api_key = env_api_key()
    opts.validate()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("serving %s", asdict(opts))
    try:
        serve(opts)
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
