"""The vLLM backend's request translation: hpcrl's admin routes (/init_broadcaster, /update_weights,
/load_lora_adapter, /pause, /resume, /weights) on vLLM's app, turned into engine-client calls and
worker RPCs (hpcrl.inference.vllm_worker), and the `policy_steps` field added to completions. The
pure parts (RPC arguments of a body, the policy a request was served by, the workers' agreement) are
functions of their own, unit-tested without vLLM.
"""

# No `from __future__ import annotations`: FastAPI resolves a route's string annotations in this
# module's globals, where the lazily imported `Request` is absent, and would take it for a query field.
import asyncio
import json
import time
from typing import Any

from hpcrl.inference.peers import DEFAULT_CONTROL_TIMEOUT_S
from hpcrl.inference.vllm_symbols import vllm_symbol


def init_broadcaster_rpc(
    body: dict[str, Any], control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S
) -> tuple[str, tuple[Any, ...]]:
    """(method, args) of the collective_rpc that /init_broadcaster sends for a request body: host, port,
    world size, rank offset, each collective's timeout, and the join's (the request's `join_timeout`,
    else the server's control_timeout_s, never above `timeout`)."""
    timeout = float(body.get("timeout", 300))
    join = float(body.get("join_timeout", control_timeout_s))
    if not (timeout > 0 and join > 0):
        raise ValueError(f"`timeout` and `join_timeout` must be > 0, got {timeout} and {join}")
    return "hpcrl_init_broadcaster", (
        str(body["host"]),
        int(body["port"]),
        int(body["world_size"]),
        int(body["rank"]),
        timeout,
        min(join, timeout),
    )


def update_weights_rpc(body: dict[str, Any], delta_base: bool = False) -> tuple[str, tuple[Any, ...]]:
    """(method, args) of the collective_rpc that /update_weights sends; ValueError for a bad body.
    `delta_base` (ServeOptions.delta_base: the run syncs deltas) tells every worker to keep the full
    weights it loads as the base of later deltas; without it a worker keeps no copy."""
    if body.get("transport") == "collective":
        return "hpcrl_update_collective", (delta_base,)
    if isinstance(body.get("path"), str):
        return "hpcrl_update_from_path", (body["path"], delta_base)
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


def router(
    status: dict[str, Any], control_timeout_s: float = DEFAULT_CONTROL_TIMEOUT_S, delta_base: bool = False
) -> Any:
    from fastapi import APIRouter, Depends, HTTPException, Request
    from fastapi.responses import JSONResponse

    from hpcrl.inference.guard import APIError, check_auth, env_api_key
    from hpcrl.inference.peers import wait_for_listener

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
            method, args = init_broadcaster_rpc(body, control_timeout_s)
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
            # Bounded like the hf backend's join (hpcrl.inference.peers): nothing accepting at host:port
            # is a 502 before any worker dials; a join not done by the deadline is a 504. A worker stuck
            # on a silent peer stays stuck until torch gives up (its RPC cannot be cancelled).
            host, port, join = args[0], args[1], args[5]
            start = time.monotonic()
            await wait_for_listener(host, port, start, start + join)
            left = max(0.0, start + join - time.monotonic())
            await asyncio.wait_for(engine.collective_rpc(method, args=args), left)  # offset + worker rank
        except APIError as e:
            return err(e.message, e.status, "BroadcastError")
        except asyncio.TimeoutError:
            return err(
                f"{host}:{port} accepted the connection but the workers' join of the weight broadcast group did "
                f"not complete within {join:g} s (a silent or slow peer; raise `join_timeout` or "
                "server.control_timeout_s)",
                504,
                "BroadcastError",
            )
        except Exception as e:
            return err(
                f"cannot join the weight broadcast group at {args[0]}:{args[1]}: {e}", 502, "BroadcastError"
            )
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
            method, args = update_weights_rpc(body, delta_base)
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


def add_policy_steps(app: Any, status: dict[str, Any]) -> None:
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
