"""vLLM backend: vLLM's own OpenAI server plus hpcrl's admin routes, through a worker extension.

Written against vLLM 0.33 (older layouts are tried where that costs one tuple entry). vLLM needs CUDA
to serve and pins other torch/transformers versions than this project's CPU environment, so this is
the only module that imports vllm, and it does so lazily. What `scripts/vllm_conformance.sh`
(tests/vllm_conformance/, vLLM 0.33's real modules imported on CPU) proves, and what still needs a
GPU (engine start, CUDA graphs, NCCL inside the workers, LoRA applied): docs/inference.md,
"The vLLM backend". The names checked there: VLLM_SYMBOLS, ENGINE_CLIENT_METHODS, APP_STATE,
WORKER_ATTRS, VLLM_LORA_RANKS.

- `--worker-extension-cls hpcrl.inference.vllm_backend.HpcrlWorkerExtension` mixes the methods below
  into every GPU worker; the API server reaches them with `engine_client.collective_rpc(name, args=...)`,
  which runs between engine steps, so an update lands between decode steps as with the hf backend.
- Extra routes are added by wrapping `build_app` in the module vLLM's `run_server_worker` reads it
  from (as prime-rl does). The listening socket is bound here, before the engine starts, so port 0
  (what SLURM jobs pass) becomes a real port with no race, and the address file names that port.

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

# No `from __future__ import annotations`: FastAPI resolves a route's string annotations in this
# module's globals, where the lazily imported `Request` is absent, and would take it for a query field.
import importlib
import json
import sys
import threading
import time
from dataclasses import replace
from functools import cache
from typing import TYPE_CHECKING, Any

from hpcrl.inference.options import VLLM_LORA_RANKS, vllm_lora_rank  # noqa: F401 (option checks; tests read them here)

if TYPE_CHECKING:
    from hpcrl.inference.options import ServeOptions

EXTENSION_CLS = "hpcrl.inference.vllm_backend.HpcrlWorkerExtension"
SUPPORTED_VLLM = "0.33"

# Every vLLM import hpcrl makes: name -> modules that define it, newest layout first. The backend
# resolves them at start and the conformance tests check them against the real vLLM.
VLLM_SYMBOLS: dict[str, tuple[str, ...]] = {
    "make_arg_parser": ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.openai.cli_args"),
    "validate_parsed_serve_args": ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.openai.cli_args"),
    "validate_api_server_args": ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.openai.api_server"),
    "FlexibleArgumentParser": ("vllm.utils.argparse_utils", "vllm.utils"),
    # build_app is patched in the module this function comes from (see _install_routes).
    "run_server_worker": (
        "vllm.entrypoints.launchers.api_server.entry",
        "vllm.entrypoints.openai.api_server",
    ),
    "LoadLoRAAdapterRequest": ("vllm.entrypoints.serve.lora.protocol", "vllm.entrypoints.openai.protocol"),
    "ErrorResponse": ("vllm.entrypoints.serve.engine.protocol", "vllm.entrypoints.openai.protocol"),
}
# Methods of app.state.engine_client the routes call, with the keyword arguments they pass.
ENGINE_CLIENT_METHODS: dict[str, tuple[str, ...]] = {
    "collective_rpc": ("args",),
    "reset_prefix_cache": (),
    "pause_generation": ("mode", "clear_cache"),
    "resume_generation": (),
}
APP_STATE = ("engine_client", "openai_serving_models")  # attributes of app.state the routes read
WORKER_ATTRS = ("rank", "device", "model_runner")  # attributes of vLLM's worker the extension reads


def _not_available(message: str) -> Exception:
    from hpcrl.config.errors import ConfigError

    return ConfigError("inference.backend", message)


def vllm_version() -> str | None:
    """The installed vLLM's version, or None when vllm is not installed."""
    import importlib.metadata
    import importlib.util

    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "unknown" if importlib.util.find_spec("vllm") is not None else None


def _missing_module(e: ModuleNotFoundError, module: str) -> bool:
    """True when `module` itself (or a package above it) does not exist, not one of its imports."""
    return bool(e.name) and (module == e.name or module.startswith(e.name + "."))


@cache
def vllm_symbol(name: str) -> Any:
    """Import one of VLLM_SYMBOLS; a one-line ConfigError that says what is missing and from which vLLM."""
    version = vllm_version()
    if version is None:
        raise _not_available(
            "vllm is not installed; `pip install 'hpcrl[gpu]'` on a GPU machine or use --inference.backend hf"
        )
    modules = VLLM_SYMBOLS[name]
    for module_name in modules:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if _missing_module(e, module_name):
                continue
            raise _not_available(
                f"vllm {version} is installed but importing {module_name} failed: {e}; "
                "install the packages vllm requires"
            ) from e
        except Exception as e:  # a broken install: CUDA libraries, an incompatible torch, ...
            raise _not_available(
                f"vllm {version} is installed but importing {module_name} failed: {type(e).__name__}: {e}"
            ) from e
        if hasattr(module, name):
            return getattr(module, name)
    raise _not_available(
        f"vllm {version} is installed but has no {name} (looked in {', '.join(modules)}); "
        f"hpcrl's vllm backend supports vLLM {SUPPORTED_VLLM}"
    )


def vllm_serve_argv(opts: "ServeOptions", model_path: str) -> list[str]:
    """The `vllm serve` flags for `opts` (pure: the conformance tests parse them with vLLM's parser)."""
    argv = [
        "--model",
        model_path,
        "--host",
        opts.host,
        "--port",
        str(opts.port),
        "--seed",
        str(opts.seed),
        "--max-model-len",
        str(opts.max_model_len),
        "--max-num-seqs",
        str(opts.max_batch_size),
        "--dtype",
        opts.dtype,
        "--served-model-name",
        opts.served_model_name or opts.model_name,
        "--tensor-parallel-size",
        str(opts.tp),
        "--worker-extension-cls",
        EXTENSION_CLS,
        "--logprobs-mode",
        "processed_logprobs",
    ]
    if opts.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(opts.gpu_memory_utilization)]
    if opts.enforce_eager:
        argv.append("--enforce-eager")
    if opts.trust_remote_code:
        argv.append("--trust-remote-code")
    if opts.lora_rank is not None:  # /load_lora_adapter needs the engine's LoRA slots
        argv += ["--enable-lora", "--max-lora-rank", str(vllm_lora_rank(opts.lora_rank))]
    return argv + list(opts.vllm_args)


# ---------------------------------------------------------------------------------------------
# Worker side (runs inside every vLLM GPU worker) and the RPCs the routes send it
# ---------------------------------------------------------------------------------------------
class HpcrlWorkerExtension:
    """Mixed into vLLM's GPU worker (`self` is the worker: WORKER_ATTRS exist there)."""

    def hpcrl_worker_rank(self) -> int:
        """This worker's rank in its server (0 .. tp x pp - 1): the router counts receivers with it."""
        return self.rank  # type: ignore[attr-defined]

    def hpcrl_init_broadcaster(
        self, host: str, port: int, world_size: int, rank_offset: int, timeout: float
    ) -> None:
        from hpcrl.weights.collective import init_group

        backend = "nccl" if self.device.type == "cuda" else "gloo"  # type: ignore[attr-defined]
        # Every worker of this server (one per tensor-parallel rank) joins with its own rank:
        # the group counts them all (hpcrl.weights.rendezvous.group_layout).
        self._hpcrl_group = init_group(
            host,
            port,
            world_size,
            rank_offset + self.rank,  # type: ignore[attr-defined]
            backend=backend,
            timeout_s=timeout,
        )

    def _hpcrl_load(self, tensors: dict[str, Any]) -> str:
        """Load full weights (HF names); keep them as the base of later deltas (where they arrived: host
        memory from a path, the worker's device from a broadcast)."""
        from hpcrl.weights.checksum import state_dict_checksum

        self._hpcrl_model().load_weights(
            weights=list(tensors.items())
        )  # vLLM maps HF names onto fused params
        self._hpcrl_full = tensors  # type: ignore[attr-defined]
        self._hpcrl_checksum = state_dict_checksum(tensors)  # type: ignore[attr-defined]
        return self._hpcrl_checksum  # type: ignore[attr-defined]

    def _hpcrl_model(self) -> Any:
        runner = self.model_runner  # type: ignore[attr-defined]
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    def _hpcrl_apply_delta(self, delta: Any) -> str:
        """Apply a delta sync. vLLM fuses (qkv_proj, gate_up_proj) and shards parameters, so the delta is
        applied to this worker's copy of the last full HF-named weights (bit-exact: new bits written
        where they changed), the touched tensors are loaded through vLLM's own `load_weights` (a copy
        into the fused slices, exact as for a full load), and the checksum is over the whole copy.
        The cost: one unsharded copy of the weights per worker (host memory for filesystem syncs, device
        memory for broadcasts) — fine for 7B, not for 70B at tp=8: keep delta off there."""
        from hpcrl.weights.checksum import state_dict_checksum
        from hpcrl.weights.delta import apply_delta

        full = getattr(self, "_hpcrl_full", None)
        if full is None or getattr(self, "_hpcrl_checksum", None) != delta.base_checksum:
            raise RuntimeError(
                f"weight delta applies to policy {delta.base_step}; this worker holds another "
                "(or no) policy: a full update is needed"
            )
        touched = apply_delta(full, delta)
        self._hpcrl_model().load_weights(weights=[(n, full[n]) for n in touched])
        self._hpcrl_checksum = state_dict_checksum(full)  # type: ignore[attr-defined]
        return self._hpcrl_checksum  # type: ignore[attr-defined]

    def hpcrl_update_from_path(self, path: str) -> str:
        from hpcrl.inference.loading import load_safetensors_dir, read_delta

        delta = read_delta(path)
        if delta is not None:  # applied where the base lives (apply_delta moves the few changed values)
            return self._hpcrl_apply_delta(delta)
        return self._hpcrl_load(load_safetensors_dir(path))

    def hpcrl_update_collective(self) -> tuple[int, str, str | None]:
        from hpcrl.weights.collective import receive_header, receive_tensors
        from hpcrl.weights.delta import Delta

        group = getattr(self, "_hpcrl_group", None)
        if group is None:
            raise RuntimeError("no weight broadcast group: call /init_broadcaster first")
        header = receive_header(group)
        tensors = receive_tensors(group, header, device=self.device)  # type: ignore[attr-defined]
        if header.adapter is not None:  # received (the sender is not left hanging), then refused
            raise RuntimeError(
                "a LoRA adapter over the collective transport is merged by the hf backend only; "
                'with vllm use trainer.broadcast.transport = "filesystem" (/load_lora_adapter)'
            )
        if header.delta is not None:
            return (
                header.step,
                self._hpcrl_apply_delta(Delta.from_manifest(header.delta, tensors)),
                header.checksum,
            )
        return header.step, self._hpcrl_load(tensors), header.checksum


def init_broadcaster_rpc(body: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
    """(method, args) of the collective_rpc that /init_broadcaster sends for a request body."""
    return "hpcrl_init_broadcaster", (
        str(body["host"]),
        int(body["port"]),
        int(body["world_size"]),
        int(body["rank"]),
        float(body.get("timeout", 300)),
    )


def update_weights_rpc(body: dict[str, Any]) -> tuple[str, tuple[Any, ...]]:
    """(method, args) of the collective_rpc that /update_weights sends; ValueError for a bad body."""
    if body.get("transport") == "collective":
        return "hpcrl_update_collective", ()
    if isinstance(body.get("path"), str):
        return "hpcrl_update_from_path", (body["path"],)
    raise ValueError('give `path` or `transport: "collective"`')


HPCRL_LORA_FIELDS = ("step",)  # hpcrl's additions to the /load_lora_adapter body; vLLM's request refuses them


def lora_request_body(body: dict[str, Any]) -> dict[str, Any]:
    """LoadLoRAAdapterRequest fields for hpcrl's body: hpcrl's own fields dropped (the route keeps them
    for the policy status), and a new policy replaces the adapter of that name in place."""
    return {"load_inplace": True, **{k: v for k, v in body.items() if k not in HPCRL_LORA_FIELDS}}


def lora_step(body: dict[str, Any]) -> int | None:
    """The policy step a /load_lora_adapter body tags the adapter with; ValueError for a bad one."""
    step = body.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise ValueError(f"`step` must be an integer >= 0, got {step!r}")
    return step


def adapter_checksum(path: str) -> str:
    """Checksum of the adapter tensors under `path` (what vLLM's LoRA manager reads from the same
    files), comparable with the trainer's and the hf engine's; APIError for a missing/bad adapter."""
    from hpcrl.inference.loading import check_finite, read_adapter
    from hpcrl.weights.checksum import state_dict_checksum

    _, raw = read_adapter(path)
    check_finite(raw, "lora_path")
    return state_dict_checksum(raw)


def initial_status() -> dict[str, Any]:
    """What /weights reports before any update: step and checksum of the loaded policy, the step of the
    base weights (requests that do not name the adapter get those), the adapter loaded (name -> path)
    and its checksum. Replaced key by key, never mutated in place: the tagging middleware snapshots it."""
    return {"step": 0, "checksum": None, "base_step": 0, "lora_adapters": {}, "lora_checksum": None}


def policy_step_for(status: dict[str, Any], model: Any) -> int:
    """The policy a request for `model` was served by: vLLM applies the adapter only to requests that
    name it; every other request runs on the base weights."""
    adapters = status.get("lora_adapters") or {}
    return status["step"] if not adapters or model in adapters else status.get("base_step", 0)


def collective_result(results: list[Any], step: int) -> tuple[str, str | None]:
    """(checksum, sender's checksum) of one update, from every worker's (step, checksum, sender's
    checksum): each worker holds its own shard, so each must have received `step` and computed the
    sender's checksum. ValueError names the first worker that did not."""
    if not results:
        raise ValueError("no vLLM worker answered the update")
    for w, (got_step, checksum, sent) in enumerate(results):
        if got_step != step:
            raise ValueError(f"worker {w} received step {got_step}, the request said {step}")
        if sent is not None and checksum != sent:
            raise ValueError(f"worker {w} loaded checksum {checksum} != sender's {sent}")
    checksums = [r[1] for r in results]
    if len(set(checksums)) != 1:
        raise ValueError(f"workers loaded different checksums {checksums}")
    return results[0][1], results[0][2]


# ---------------------------------------------------------------------------------------------
# API server side
# ---------------------------------------------------------------------------------------------
def _router(status: dict[str, Any]) -> Any:
    from fastapi import APIRouter, Depends, HTTPException, Request
    from fastapi.responses import JSONResponse

    from hpcrl.inference.guard import APIError, check_auth, env_api_key

    def authorized(request: Request) -> None:
        """Every added (admin) route needs the run's key, like vLLM's own routes with VLLM_API_KEY."""
        try:
            check_auth(request.url.path, request.headers.get("authorization"), env_api_key())
        except APIError as e:
            raise HTTPException(e.status, e.message, headers={"WWW-Authenticate": "Bearer"}) from None

    router = APIRouter(dependencies=[Depends(authorized)])

    def err(message: str, status_code: int, type_: str) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": message, "type": type_, "param": None, "code": status_code}},
            status_code=status_code,
        )

    async def body_of(request: Request) -> dict[str, Any] | JSONResponse:
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return err(f"request body is not valid JSON: {e}", 400, "BadRequestError")
        return (
            body
            if isinstance(body, dict)
            else err("request body must be a JSON object", 400, "BadRequestError")
        )

    @router.post("/init_broadcaster")
    async def init_broadcaster(request: Request) -> Any:
        body = await body_of(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            method, args = init_broadcaster_rpc(body)
            announced = int(body.get("receivers", 0))
        except (KeyError, TypeError, ValueError) as e:
            return err(
                f"/init_broadcaster needs host, port, world_size, rank (and receivers): {e}",
                400,
                "BadRequestError",
            )
        engine = request.app.state.engine_client
        world, offset = args[2], args[3]
        try:
            # Count the workers before joining: a group sized for another count would only time out.
            ranks = sorted(await engine.collective_rpc("hpcrl_worker_rank"))
            if ranks != list(range(len(ranks))) or (announced and announced != len(ranks)):
                return err(
                    f"this server runs {len(ranks)} weight-receiving worker(s) (ranks {ranks}), the "
                    f"group counts it as {announced or '?'}",
                    409,
                    "BroadcastError",
                )
            if offset < 1 or offset + len(ranks) > world:
                return err(
                    f"ranks {offset}..{offset + len(ranks) - 1} of this server's workers do not fit "
                    f"world_size {world}",
                    400,
                    "BadRequestError",
                )
            await engine.collective_rpc(method, args=args)  # each worker joins as offset + its rank
        except Exception as e:
            return err(f"cannot join the weight broadcast group: {e}", 502, "BroadcastError")
        return {"status": "ok", "rank": offset, "receivers": len(ranks), "world_size": world}

    @router.post("/update_weights")
    async def update_weights(request: Request) -> Any:
        body = await body_of(request)
        if isinstance(body, JSONResponse):
            return body
        engine = request.app.state.engine_client
        step = body.get("step")
        if not isinstance(step, int) or step < 0:
            return err("`step` (an integer >= 0) is required", 400, "BadRequestError")
        try:
            method, args = update_weights_rpc(body)
        except ValueError as e:
            return err(str(e), 400, "BadRequestError")
        try:
            results = await engine.collective_rpc(method, args=args)  # one per worker
        except Exception as e:
            return err(f"weight update failed: {e}", 400, "WeightSyncError")
        if method != "hpcrl_update_collective":  # a path load answers only its checksum
            results = [(step, checksum, None) for checksum in results]
        try:
            checksum, sent = collective_result(results, step)
        except ValueError as e:
            status.update(step=step, checksum=None)  # the workers disagree: nothing verified is loaded
            return err(f"weight update to step {step} failed verification: {e}", 409, "WeightSyncError")
        await engine.reset_prefix_cache()  # cached KV was computed with the old weights
        expected = body.get("expected_checksum") or sent
        # Full weights replace the base; requests naming a previous adapter would mix it with the new
        # base, so it is no longer reported as the policy (the orchestrator names the base again).
        status.update(step=step, checksum=checksum, base_step=step, lora_adapters={}, lora_checksum=None)
        if expected is not None and expected != checksum:
            return err(f"loaded checksum {checksum} != expected {expected}", 409, "WeightSyncError")
        return {"step": step, "checksum": checksum}

    @router.get("/weights")
    async def weights() -> Any:
        return dict(status)

    @router.post("/pause")
    async def pause(request: Request) -> Any:
        # "keep": in-flight requests freeze and continue after /resume, as with the hf backend (vLLM's
        # default, "abort", would fail them); the prefix cache is reset by /update_weights instead.
        await request.app.state.engine_client.pause_generation(mode="keep", clear_cache=False)
        return {"status": "paused", "policy_step": status["step"]}

    @router.post("/resume")
    async def resume(request: Request) -> Any:
        await request.app.state.engine_client.resume_generation()
        return {"status": "running", "policy_step": status["step"]}

    @router.post("/load_lora_adapter")
    async def load_lora(request: Request) -> Any:
        import asyncio

        from hpcrl.inference.protocol import APIError

        body = await body_of(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            step = lora_step(body)
            lora_request = vllm_symbol("LoadLoRAAdapterRequest")(**lora_request_body(body))
        except ValueError as e:  # pydantic's ValidationError is a ValueError
            return err(
                f"/load_lora_adapter needs `lora_name` and `lora_path` strings (and an integer `step`): {e}",
                400,
                "BadRequestError",
            )
        try:  # read before vLLM loads: a bad adapter is refused before anything is replaced
            checksum = await asyncio.to_thread(adapter_checksum, lora_request.lora_path)
        except APIError as e:
            return err(e.message, 400, "BadRequestError")
        result = await request.app.state.openai_serving_models.load_lora_adapter(lora_request)
        if isinstance(result, vllm_symbol("ErrorResponse")):
            return JSONResponse(result.model_dump(), status_code=result.error.code)
        await request.app.state.engine_client.reset_prefix_cache()
        status.update(
            lora_adapters={lora_request.lora_name: lora_request.lora_path},
            lora_checksum=checksum,
            **({"step": step} if step is not None else {}),
        )
        return {
            "status": "ok",
            "lora_name": lora_request.lora_name,
            "checksum": checksum,
            "step": status["step"],
        }

    return router


def _add_policy_steps(app: Any, status: dict[str, Any]) -> None:
    """Add `policy_steps` to every non-streamed completion response (hpcrl extension)."""
    from fastapi import Request
    from fastapi.responses import Response

    # vLLM 0.33's build_app ends with a SageMaker bootstrap that builds the middleware stack, after
    # which Starlette refuses new middleware. That stack is built from app.user_middleware alone, so
    # dropping it is lossless: Starlette rebuilds it, with this one, on the first request.
    app.middleware_stack = None

    @app.middleware("http")
    async def policy_steps(request: Request, call_next: Any) -> Any:
        start = dict(status)  # the loaded policy when the request started
        response = await call_next(request)
        if request.url.path not in ("/v1/chat/completions", "/v1/completions") or not response.headers.get(
            "content-type", ""
        ).startswith("application/json"):
            return response
        raw = b"".join([chunk async for chunk in response.body_iterator])
        try:
            data = json.loads(raw)
            model = data.get("model")  # vLLM answers with the adapter's name when it applied it
            steps = sorted({policy_step_for(start, model), policy_step_for(status, model)})
            for choice in data.get("choices", []):
                choice["policy_steps"] = steps
            data["policy_steps"] = steps
            raw = json.dumps(data).encode()
        except (ValueError, AttributeError):
            pass
        headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
        return Response(raw, status_code=response.status_code, headers=headers, media_type="application/json")


def _install_routes(run_server_worker: Any, status: dict[str, Any]) -> None:
    """Wrap build_app where run_server_worker's module looks it up, so the served app has hpcrl's routes."""
    module = sys.modules[run_server_worker.__module__]
    original = module.build_app

    def build_app(*args: Any, **kwargs: Any) -> Any:
        app = original(*args, **kwargs)
        app.include_router(_router(status))
        _add_policy_steps(app, status)
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
    """vLLM's own parser and validators applied to `vllm_serve_argv` (argparse exits 2 on bad flags)."""
    parser = vllm_symbol("make_arg_parser")(vllm_symbol("FlexibleArgumentParser")(prog="vllm serve"))
    args = parser.parse_args(vllm_serve_argv(opts, model_path))
    vllm_symbol("validate_parsed_serve_args")(args)
    vllm_symbol("validate_api_server_args")(args)
    return args


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

    sock, opts, args = prepare(opts, model_path)
    run_server_worker = vllm_symbol("run_server_worker")
    status = initial_status()
    _install_routes(run_server_worker, status)
    threading.Thread(target=_announce_when_ready, args=(opts,), daemon=True).start()
    host = f"[{opts.host}]" if ":" in opts.host else opts.host
    asyncio.run(run_server_worker(f"http://{host}:{opts.port}", sock, args))
