"""vLLM backend: vLLM's own OpenAI server plus hpcrl's admin routes, through a worker extension.

UNTESTED HERE. vLLM needs CUDA and pins other torch/transformers versions than this project's CPU
environment, so this module is the only one that imports vllm, does so lazily, and is exercised only
on GPU machines. It follows vLLM's documented RLHF hooks (checked against the vLLM docs/examples,
0.10-0.11 API):

- `--worker-extension-cls hpcrl.inference.vllm_backend.HpcrlWorkerExtension` mixes the methods below
  into every GPU worker; the API server reaches them with `engine_client.collective_rpc(name, args=...)`,
  which runs between engine steps, so an update lands between decode steps as with the hf backend.
- Extra routes are added by wrapping `vllm.entrypoints.openai.api_server.build_app` (as prime-rl does).

Same API as the hf backend: vLLM itself provides /v1/chat/completions, /v1/completions (token-id
prompts), `return_token_ids`, logprobs, /tokenize, /health and /v1/models. hpcrl adds /update_weights
(path or collective), /init_broadcaster, /load_lora_adapter, /pause, /resume, /weights, and a
`policy_steps` field per choice. Differences, by necessity:
- vLLM fuses and renames parameters (qkv_proj, gate_up_proj), so the checksum is computed over the
  tensors the worker received (HF names) rather than read back from the model;
- `policy_steps` lists the policy steps loaded when the request started and ended (vLLM does not tag
  tokens), which is exact whenever updates happen while the server is paused.
- vLLM's sampler reports logprobs of the raw model distribution unless started with
  `--logprobs-mode processed_logprobs` (vLLM >= 0.10.2), which `serve` passes.
"""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpcrl.inference.server import ServeOptions

EXTENSION_CLS = "hpcrl.inference.vllm_backend.HpcrlWorkerExtension"


class HpcrlWorkerExtension:
    """Mixed into vLLM's GPU worker (`self` is the worker: model_runner, device, rank exist there)."""

    def hpcrl_init_broadcaster(self, host: str, port: int, world_size: int, rank_offset: int,
                               timeout: float) -> None:
        from hpcrl.weights.collective import init_group

        # Every worker of this server (one per tensor-parallel rank) joins with its own rank.
        self._hpcrl_group = init_group(host, port, world_size, rank_offset + self.rank,  # type: ignore[attr-defined]
                                       backend="nccl", timeout_s=timeout)

    def _hpcrl_load(self, tensors: dict[str, Any]) -> str:
        from hpcrl.weights.checksum import state_dict_checksum

        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        model.load_weights(weights=list(tensors.items()))  # vLLM maps HF names onto fused params
        return state_dict_checksum(tensors)

    def hpcrl_update_from_path(self, path: str) -> str:
        from hpcrl.inference.loading import load_safetensors_dir

        return self._hpcrl_load(load_safetensors_dir(path))

    def hpcrl_update_collective(self) -> tuple[int, str, str | None]:
        from hpcrl.weights.collective import receive_header, receive_tensors

        group = getattr(self, "_hpcrl_group", None)
        if group is None:
            raise RuntimeError("no weight broadcast group: call /init_broadcaster first")
        header = receive_header(group)
        tensors = receive_tensors(group, header, device=self.device)  # type: ignore[attr-defined]
        return header.step, self._hpcrl_load(tensors), header.checksum


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
        return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": status_code}},
                            status_code=status_code)

    async def body_of(request: Request) -> dict[str, Any] | JSONResponse:
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return err(f"request body is not valid JSON: {e}", 400, "BadRequestError")
        return body if isinstance(body, dict) else err("request body must be a JSON object", 400, "BadRequestError")

    @router.post("/init_broadcaster")
    async def init_broadcaster(request: Request) -> Any:
        body = await body_of(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            await request.app.state.engine_client.collective_rpc(
                "hpcrl_init_broadcaster", args=(body["host"], int(body["port"]), int(body["world_size"]),
                                                int(body["rank"]), float(body.get("timeout", 300))))
        except Exception as e:
            return err(f"cannot join the weight broadcast group: {e}", 502, "BroadcastError")
        return {"status": "ok"}

    @router.post("/update_weights")
    async def update_weights(request: Request) -> Any:
        body = await body_of(request)
        if isinstance(body, JSONResponse):
            return body
        engine = request.app.state.engine_client
        step = body.get("step")
        if not isinstance(step, int) or step < 0:
            return err("`step` (an integer >= 0) is required", 400, "BadRequestError")
        sent = None
        try:
            if body.get("transport") == "collective":
                results = await engine.collective_rpc("hpcrl_update_collective")
                got_step, checksum, sent = results[0]
                if got_step != step:
                    return err(f"the broadcast carried step {got_step}, the request said {step}", 409,
                               "WeightSyncError")
            elif isinstance(body.get("path"), str):
                checksum = (await engine.collective_rpc("hpcrl_update_from_path", args=(body["path"],)))[0]
            else:
                return err('give `path` or `transport: "collective"`', 400, "BadRequestError")
        except Exception as e:
            return err(f"weight update failed: {e}", 400, "WeightSyncError")
        await engine.reset_prefix_cache()  # cached KV was computed with the old weights
        expected = body.get("expected_checksum") or sent
        status.update(step=step, checksum=checksum)
        if expected is not None and expected != checksum:
            return err(f"loaded checksum {checksum} != expected {expected}", 409, "WeightSyncError")
        return {"step": step, "checksum": checksum}

    @router.get("/weights")
    async def weights() -> Any:
        return dict(status)

    @router.post("/pause")
    async def pause(request: Request) -> Any:
        fn = getattr(request.app.state.engine_client, "pause_generation", None)
        if fn is None:
            return err("this vLLM version cannot pause generation", 501, "NotImplementedError")
        await fn()
        return {"status": "paused", "policy_step": status["step"]}

    @router.post("/resume")
    async def resume(request: Request) -> Any:
        fn = getattr(request.app.state.engine_client, "resume_generation", None)
        if fn is None:
            return err("this vLLM version cannot resume generation", 501, "NotImplementedError")
        await fn()
        return {"status": "running", "policy_step": status["step"]}

    @router.post("/load_lora_adapter")
    async def load_lora(request: Request) -> Any:
        try:  # moved between vLLM releases
            from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest
        except ImportError:
            from vllm.entrypoints.openai.protocol import LoadLoRAAdapterRequest

        body = await body_of(request)
        if isinstance(body, JSONResponse):
            return body
        handler = request.app.state.openai_serving_models
        result = await handler.load_lora_adapter(LoadLoRAAdapterRequest(**body))
        if hasattr(result, "error"):
            return JSONResponse(result.model_dump(), status_code=result.error.code)
        await request.app.state.engine_client.reset_prefix_cache()
        return {"status": "ok", "lora_name": body.get("lora_name")}

    return router


def _add_policy_steps(app: Any, status: dict[str, Any]) -> None:
    """Add `policy_steps` to every non-streamed completion response (hpcrl extension)."""
    from fastapi import Request
    from fastapi.responses import Response

    @app.middleware("http")
    async def policy_steps(request: Request, call_next: Any) -> Any:
        start = status["step"]
        response = await call_next(request)
        if request.url.path not in ("/v1/chat/completions", "/v1/completions") or \
                not response.headers.get("content-type", "").startswith("application/json"):
            return response
        raw = b"".join([chunk async for chunk in response.body_iterator])
        try:
            data = json.loads(raw)
            steps = sorted({start, status["step"]})
            for choice in data.get("choices", []):
                choice["policy_steps"] = steps
            data["policy_steps"] = steps
            raw = json.dumps(data).encode()
        except (ValueError, AttributeError):
            pass
        headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
        return Response(raw, status_code=response.status_code, headers=headers, media_type="application/json")


def _announce_when_ready(opts: ServeOptions, port: int) -> None:
    import httpx

    from hpcrl.inference.server import write_server_info

    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                write_server_info(opts, port)
                print(f"hpcrl inference ready on port {port} (backend vllm)", flush=True)
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)


def serve(opts: ServeOptions, model_path: str) -> None:
    """Run vLLM's OpenAI server with hpcrl's worker extension and admin routes (blocks)."""
    import asyncio

    if opts.port == 0:
        raise ValueError("server.port: the vllm backend needs an explicit port (0 is hf-only)")

    try:
        import vllm.entrypoints.openai.api_server as api_server
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    except ImportError as e:
        raise ValueError(f"inference.backend: vllm is not installed ({e}); `pip install hpcrl[gpu]` "
                         "on a GPU machine or use backend hf") from e

    status: dict[str, Any] = {"step": 0, "checksum": None}
    original_build_app = api_server.build_app

    def build_app(*args: Any, **kwargs: Any) -> Any:
        app = original_build_app(*args, **kwargs)
        app.include_router(_router(status))
        _add_policy_steps(app, status)
        return app

    api_server.build_app = build_app
    try:  # moved between vLLM releases
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser
    parser = make_arg_parser(FlexibleArgumentParser())
    argv = ["--model", model_path, "--host", opts.host, "--port", str(opts.port), "--seed", str(opts.seed),
            "--max-model-len", str(opts.max_model_len), "--max-num-seqs", str(opts.max_batch_size),
            "--dtype", opts.dtype, "--served-model-name", opts.served_model_name or opts.model_name,
            "--worker-extension-cls", EXTENSION_CLS, "--logprobs-mode", "processed_logprobs",
            *opts.vllm_args]
    args = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    threading.Thread(target=_announce_when_ready, args=(opts, opts.port), daemon=True).start()
    asyncio.run(api_server.run_server(args))
