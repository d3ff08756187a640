"""vLLM backend, process side: vLLM's own OpenAI server started with hpcrl's worker extension and
admin routes. Split by concern, as the embedded engine is:

- this module: start and announce the server (argv for `vllm serve`, vLLM's parser, the socket bound
  before the engine loads, the address file once /health answers);
- vllm_worker.py: weight transfer inside every GPU worker (`--worker-extension-cls`);
- vllm_routes.py: request translation (hpcrl's admin routes as engine-client calls and worker RPCs,
  the `policy_steps` field);
- vllm_symbols.py: every vLLM name hpcrl uses and where to find it.

Written against vLLM 0.33 (older layouts are tried where that costs one tuple entry). vLLM needs CUDA
to serve and pins other torch/transformers versions than this project's CPU environment, so only these
modules import vllm, and lazily. What `scripts/vllm_conformance.sh` (tests/vllm_conformance/, vLLM
0.33's real modules imported on CPU) proves, and what still needs a GPU (engine start, CUDA graphs, NCCL
inside the workers, LoRA applied): docs/inference.md, "The vLLM backend". The names checked there:
VLLM_SYMBOLS, ENGINE_CLIENT_METHODS, APP_STATE, WORKER_ATTRS, VLLM_LORA_RANKS.

Extra routes are added by wrapping `build_app` in the module vLLM's `run_server_worker` reads it from
(as prime-rl does). The listening socket is bound here, before the engine starts, so port 0 (what SLURM
jobs pass) becomes a real port with no race, and the address file names that port.

Same API as the hf backend: vLLM itself provides /v1/chat/completions, /v1/completions (token-id
prompts), `return_token_ids`, logprobs, /tokenize, /health and /v1/models. hpcrl adds /update_weights
(path or collective), /init_broadcaster, /load_lora_adapter, /pause, /resume, /weights, and a
`policy_steps` field per choice. Differences, by necessity:
- vLLM fuses and renames parameters (qkv_proj, gate_up_proj), so the checksum is computed over the
  tensors the worker received (HF names) rather than read back from the model;
- `policy_steps` lists the policy steps loaded when the request started and ended (vLLM does not tag
  tokens), which is exact whenever updates happen while the server is paused; with a LoRA adapter
  loaded, a request that does not name it ran on the base weights and gets the base's step.
- LoRA: vLLM applies an adapter only to requests naming it (the orchestrator names it once loaded);
  the checksum is over the adapter files vLLM was pointed at. Adapters over the collective transport
  are merged by the hf backend only (vLLM loads adapters from a path).
- vLLM's sampler reports logprobs of the raw model distribution unless started with
  `--logprobs-mode processed_logprobs` (vLLM >= 0.10.2), which `serve` passes.
"""

import sys
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hpcrl.inference.options import VLLM_LORA_RANKS, vllm_lora_rank  # noqa: F401 (option checks; tests read them here)
from hpcrl.inference.vllm_symbols import SUPPORTED_VLLM, VLLM_SYMBOLS, vllm_symbol, vllm_version  # noqa: F401

if TYPE_CHECKING:
    from hpcrl.inference.options import ServeOptions

EXTENSION_CLS = "hpcrl.inference.vllm_worker.HpcrlWorkerExtension"


def hpcrl_args(opts: "ServeOptions", model_path: str) -> dict[str, Any]:
    """The engine arguments hpcrl decides from its own fields (pure)."""
    args: dict[str, Any] = {
        "model": model_path,
        "host": opts.host,
        "port": opts.port,
        "seed": opts.seed,
        "max_model_len": opts.max_model_len,
        "max_num_seqs": opts.max_batch_size,
        "dtype": opts.dtype,
        "served_model_name": opts.served_model_name or opts.model_name,
        "tensor_parallel_size": opts.tp,
        "worker_extension_cls": EXTENSION_CLS,
        "logprobs_mode": "processed_logprobs",
        "enable_scale_out": True,  # vLLM 0.33 answers /inference/v1/generate with 403 without it
    }
    if opts.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = opts.gpu_memory_utilization
    if opts.enforce_eager:
        args["enforce_eager"] = True
    if opts.quantization is not None:  # online: vLLM quantizes the bf16 policy as it loads it
        args["quantization"] = opts.quantization
    if opts.trust_remote_code:
        args["trust_remote_code"] = True
    if opts.lora_rank is not None:  # /load_lora_adapter needs the engine's LoRA slots
        args.update(enable_lora=True, max_lora_rank=vllm_lora_rank(opts.lora_rank))
    if _is_moe(model_path):  # router replay: every choice carries the experts its tokens went to
        args["enable_return_routed_experts"] = True
    return args


def vllm_serve_argv(opts: "ServeOptions", model_path: str, parser: Any = None) -> list[str]:
    """The `vllm serve` flags for `opts` (pure: the conformance tests parse them with vLLM's parser):
    hpcrl's own arguments under [inference.vllm]'s (hpcrl.inference.vllm_args; the config made sure
    they do not contradict each other), then the extra flags of `python -m hpcrl.inference.server`."""
    from hpcrl.inference.vllm_args import to_argv

    return to_argv({**hpcrl_args(opts, model_path), **opts.engine_args}, parser) + list(opts.vllm_args)


def _is_moe(model_path: str) -> bool:
    from hpcrl.models.arch import find_arch

    arch = find_arch(model_path)
    return arch is not None and arch.moe


def _install_routes(
    run_server_worker: Any, status: dict[str, Any], control_timeout_s: float = 8.0, delta_base: bool = False
) -> None:
    """Wrap build_app where run_server_worker's module looks it up, so the served app has hpcrl's routes."""
    from hpcrl.inference.prom import register_lost_lines
    from hpcrl.inference.vllm_routes import add_policy_steps, router

    module = sys.modules[run_server_worker.__module__]
    original = module.build_app

    def build_app(*args: Any, **kwargs: Any) -> Any:
        app = original(*args, **kwargs)
        app.include_router(router(status, control_timeout_s, delta_base))
        add_policy_steps(app, status)
        register_lost_lines()  # its /metrics: this process's log lines the disk refused
        return app

    module.build_app = build_app


def _announce_when_ready(opts: "ServeOptions") -> None:
    import httpx

    from hpcrl.inference.options import write_server_info

    dial = "127.0.0.1" if opts.host in ("0.0.0.0", "::", "") else opts.host
    url = f"http://{dial}:{opts.port}/health"
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                write_server_info(opts, opts.port)
                print(f"hpcrl inference ready on port {opts.port} (backend vllm)", flush=True)
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)


def parse_serve_args(opts: "ServeOptions", model_path: str) -> Any:
    """vLLM's own parser and validators applied to `vllm_serve_argv`: an argument it refuses is a
    ConfigError naming the [inference.vllm] key it came from (argparse exits 2 on hpcrl's own flags)."""
    from hpcrl.inference.vllm_args import parse, vllm_parser

    if not opts.engine_args:  # nothing of the user's: vLLM's parser as it is
        parser = vllm_parser()
        args = parser.parse_args(vllm_serve_argv(opts, model_path, parser))
        vllm_symbol("validate_parsed_serve_args")(args)
        vllm_symbol("validate_api_server_args")(args)
        return args
    return parse(vllm_serve_argv(opts, model_path, vllm_parser()), set(opts.engine_args))


def prepare(opts: "ServeOptions", model_path: str) -> tuple[Any, "ServeOptions", Any]:
    """Resolve vLLM, bind the socket, parse vLLM's args: (socket, opts with the real port, args)."""
    from hpcrl.inference.options import bind_server_socket

    for name in VLLM_SYMBOLS:  # every missing name is reported now, not at the first request
        vllm_symbol(name)
    # Bound before the engine loads (minutes on a big model): port 0 becomes a real port that no
    # other process can take in between, and vLLM serves on this very socket.
    sock = bind_server_socket(opts.host, opts.port)
    sock.listen()  # a socket only bound does not stop another SO_REUSEADDR bind; a listening one does
    opts = replace(opts, port=sock.getsockname()[1])
    try:
        return sock, opts, parse_serve_args(opts, model_path)
    except BaseException:
        sock.close()
        raise


def serve(opts: "ServeOptions", model_path: str) -> None:
    """Run vLLM's OpenAI server with hpcrl's worker extension and admin routes (blocks)."""
    import asyncio
    import os

    from hpcrl.inference.http_protocol import install_as_auto
    from hpcrl.inference.vllm_routes import initial_status

    os.environ.update(opts.engine_env)  # before vLLM loads: its workers inherit them (use_deep_gemm)
    sock, opts, args = prepare(opts, model_path)
    run_server_worker = vllm_symbol("run_server_worker")
    status = initial_status()
    _install_routes(run_server_worker, status, opts.control_timeout_s, opts.delta_base)
    install_as_auto()  # vLLM's uvicorn config asks for "auto": answer clients that half-close too
    threading.Thread(target=_announce_when_ready, args=(opts,), daemon=True).start()
    host = f"[{opts.host}]" if ":" in opts.host else opts.host
    asyncio.run(run_server_worker(f"http://{host}:{opts.port}", sock, args))
