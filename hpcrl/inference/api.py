"""The HTTP API of the embedded (hf) backend: OpenAI/vLLM routes plus hpcrl's admin routes.

Every handler validates its input before it touches the engine, and every failure is answered as
`{"error": {"message", "type", "param", "code"}}` with a 4xx/5xx status: no request can kill the server.
Blocking work (tokenizing, reading weights, receiving a broadcast) runs in threads so the event loop
keeps answering /health while it happens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from hpcrl.bus.messages import ADAPTER_NAME
from hpcrl.inference import guard, peers
from hpcrl.inference.content import has_images
from hpcrl.inference.engine import HFEngine
from hpcrl.inference.errors import (
    EngineError,
    EngineFailed,
    InvalidRequest,
    ShuttingDown,
    WeightSyncRefused,
    for_field,
)
from hpcrl.inference.protocol import (
    APIError,
    _bool,
    _int,
    _int_list,
    chat_response,
    check_typed_fields,
    completion_response,
    not_found,
    parse_chat_render,
    parse_completion_prompts,
    parse_sampling,
    show,
)
from hpcrl.inference.protocol import (
    _float as protocol_float,
)

log = logging.getLogger("hpcrl.inference.api")
MAX_WORLD = 1 << 20  # ranks of a weight-broadcast group (torch's store takes a 32-bit count)
MAX_STEP = 2**62  # a policy step; anything larger is a client bug, not a policy
MIN_BODY_BYTES = 4 << 20
BODY_BYTES_PER_TOKEN = 64
MAX_LORA_NAME = 256


class ServerState:
    """What the routes share: the engine, the served names, the broadcast group, the sync status."""

    def __init__(
        self,
        engine: HFEngine,
        served_name: str,
        model_path: str,
        *,
        api_key: str | None = None,
        run_dir: str | None = None,
        allow_any_weights_path: bool = False,
        control_timeout_s: float = peers.DEFAULT_CONTROL_TIMEOUT_S,
    ):
        self.engine = engine
        self.control_timeout_s = control_timeout_s  # how long a control route may wait on a peer
        self.api_key, self.run_dir, self.allow_any_weights_path = api_key, run_dir, allow_any_weights_path
        self.served_name = served_name
        self.model_path = model_path
        self.group: Any = None
        self.sync_error: str | None = None  # set when a loaded update failed verification
        self.update_lock = asyncio.Lock()
        self.max_body_bytes = max_body_bytes(engine.max_model_len)
        self.started = time.time()
        self.http_errors = 0

    def names(self) -> set[str]:
        return {
            self.served_name,
            self.model_path,
            os.path.basename(self.model_path.rstrip("/")),
            *self.engine.lora_adapters,
        }


def max_body_bytes(max_model_len: int) -> int:
    """The largest request body read: 64 bytes per context token (a token's text JSON-escaped, or its
    id, with room to spare), 4 MiB at least. Parsing, rendering and tokenizing cost time in proportion
    to the body, and the tokenizer is shared, so an unbounded body would stall every other request."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len)


def _too_large(limit: int) -> APIError:
    return APIError(
        f"request body is larger than {limit} bytes, the most this server reads (request entity too large)",
        status=413,
        type="RequestTooLargeError",
    )


async def _body(request: Request) -> dict[str, Any]:
    limit = request.app.state.hpcrl.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():  # chunked bodies too: stop reading at the limit
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"request body is not valid JSON: {e}", type="BadRequestError") from e
    except RecursionError:
        raise APIError(f"request body nests more than {guard.MAX_JSON_DEPTH} levels deep") from None
    if not isinstance(body, dict):
        raise APIError("request body must be a JSON object")
    guard.check_body(body)
    return body


def _json(obj: dict[str, Any]) -> Response:
    """Encode a response with msgspec: FastAPI's default path (jsonable_encoder walking every per-token
    dict, then json.dumps) cost more than the decode steps for a batch of logprob-carrying choices."""
    return Response(msgspec.json.encode(obj), media_type="application/json")


def _check_model(state: ServerState, body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        return state.served_name
    if not isinstance(model, str) or model not in state.names():
        shown = model if isinstance(model, str) and len(model) <= 200 else show(model)
        raise not_found(f"The model `{shown}` does not exist.", param="model")
    return model


# How each engine refusal answers over HTTP: (status, OpenAI error type).
ENGINE_ERROR_HTTP: dict[type[EngineError], tuple[int, str]] = {
    InvalidRequest: (400, "BadRequestError"),
    WeightSyncRefused: (409, "WeightSyncError"),
    ShuttingDown: (503, "ServiceUnavailableError"),
    EngineFailed: (500, "InternalServerError"),
}


def api_error(exc: EngineError) -> APIError:
    """The HTTP answer to an engine refusal (the engine itself knows nothing of HTTP)."""
    status, kind = next(
        (v for t, v in ENGINE_ERROR_HTTP.items() if isinstance(exc, t)), (500, "InternalServerError")
    )
    return APIError(exc.message, status=status, type=kind, param=exc.param)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="hpcrl inference", docs_url=None, redoc_url=None)
    app.state.hpcrl = state
    engine = state.engine

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        state.http_errors += 1
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return await _api_error(request, api_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        state.http_errors += 1
        return JSONResponse(
            APIError(str(exc.detail), status=exc.status_code, type="HTTPError").body(),
            status_code=exc.status_code,
        )

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Response:
        try:
            guard.check_auth(request.url.path, request.headers.get("authorization"), state.api_key)
        except APIError as exc:
            state.http_errors += 1
            return JSONResponse(exc.body(), status_code=exc.status, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        state.http_errors += 1
        err = APIError(f"internal error: {type(exc).__name__}: {exc}", status=500, type="InternalServerError")
        return JSONResponse(err.body(), status_code=500)

    async def generate(
        prompt: list[int], body: dict[str, Any], chat: bool, prompt_field: str, mm: Any = None
    ) -> tuple[Any, Any]:
        if state.sync_error:
            raise APIError(state.sync_error, status=503, type="WeightSyncError")
        params = parse_sampling(body, chat=chat)
        max_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        try:
            fut = engine.submit(prompt, params, mm) if mm is not None else engine.submit(prompt, params)
        except EngineError as e:  # named as the client wrote it, not in the engine's terms
            raise for_field(e, {"prompt": prompt_field, "max_tokens": max_field}) from None
        return params, await asyncio.wrap_future(fut)

    # -- health and introspection ----------------------------------------------------------------------
    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok" if not state.sync_error else "weights_unverified",
            "model": state.served_name,
            "policy_step": engine.policy_step,
            "paused": engine.paused,
            **engine.load(),
            "max_batch_size_seen": engine.stats["max_batch_size_seen"],
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text under vLLM's names (hpcrl.inference.prom): KV usage, queue, preemptions."""
        from hpcrl.inference.prom import exposition
        from hpcrl.storage import dropped_log_lines

        load = engine.load()
        text = exposition(
            state.served_name,
            running=load["running"],
            waiting=load["waiting"],
            kv_used=engine.kv_used(),
            kv_capacity=engine.kv_capacity,
            preemptions=engine.stats["preemptions"],
            generated_tokens=engine.stats["generated_tokens"],
            max_model_len=engine.max_model_len,
            max_batch_size=engine.max_batch_size,
            log_lost=dropped_log_lines(),
        )
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """The engine's own counters as JSON (batch sizes seen, forward steps, errors, ...)."""
        stats = dict(engine.stats)
        stats["batch_size_hist"] = {str(k): v for k, v in sorted(stats["batch_size_hist"].items())}
        return {
            **stats,
            **engine.load(),
            "policy_step": engine.policy_step,
            "http_errors": state.http_errors,
            "uptime_s": time.time() - state.started,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        data = [
            {
                "id": name,
                "object": "model",
                "created": int(state.started),
                "owned_by": "hpcrl",
                "root": state.model_path,
                "parent": None if name == state.served_name else state.served_name,
                "max_model_len": engine.max_model_len,
            }
            for name in [state.served_name, *engine.lora_adapters]
        ]
        return {"object": "list", "data": data}

    @app.get("/weights")
    async def weights() -> dict[str, Any]:
        return {**engine.weights_info(), "verified": state.sync_error is None, "error": state.sync_error}

    # -- generation ------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _body(request)
        model = _check_model(state, body)
        parse_sampling(body, chat=True)  # reject bad sampling before paying for the template
        tools = body.get("tools")
        prompt_field = "messages"
        mm = None
        if body.get("prompt_token_ids") is not None:  # exact continuation of a stitched conversation
            prompt = _int_list(body["prompt_token_ids"], "prompt_token_ids")
            prompt_field = "prompt_token_ids"
        else:
            messages, agp, cont, kwargs = parse_chat_render(body)
            if has_images(messages):  # a vision-language model: image tokens expanded, pixels computed
                prompt, mm = await asyncio.to_thread(engine.vision_prompt, messages, tools, agp, cont, kwargs)
            else:
                prompt = engine.tokens.cached_chat(engine.tokens.chat_key(messages, tools, agp, cont, kwargs))
            if prompt is None:  # a template render is slow enough to keep off the event loop
                prompt = await asyncio.to_thread(
                    engine.tokens.encode_chat, messages, tools, agp, cont, kwargs
                )
        params, outs = await generate(prompt, body, chat=True, prompt_field=prompt_field, mm=mm)
        return _json(
            chat_response(
                model,
                prompt,
                outs,
                params,
                parse_tools=bool(tools),
                token_str=lambda t: engine.tokens.token_info(t)[0],
                token_bytes=lambda t: engine.tokens.token_info(t)[1],
            )
        )

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _body(request)
        model = _check_model(state, body)
        parse_sampling(body, chat=False)
        prompts = [
            p if isinstance(p, list) else await asyncio.to_thread(engine.tokens.encode_text, p)
            for p in parse_completion_prompts(body)
        ]
        results = await asyncio.gather(
            *(generate(p, body, chat=False, prompt_field="prompt") for p in prompts)
        )
        params = results[0][0]
        resp = completion_response(
            model,
            prompts,
            [outs for _, outs in results],
            params,
            token_str=lambda t: engine.tokens.token_info(t)[0],
        )
        if body.get("prompt_logprobs") is not None:
            await add_prompt_logprobs(resp, prompts, body["prompt_logprobs"], params.n)
        return _json(resp)

    async def add_prompt_logprobs(resp: dict[str, Any], prompts: list[list[int]], k: Any, n: int) -> None:
        """vLLM's shape: choices[i].prompt_logprobs = [None, {"<id>": {"logprob", "rank", "decoded_token"}}, ...]
        for the prompt's own tokens (top-k alternatives beyond them are not computed: k must be 0 or 1)."""
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 1:
            raise APIError(
                "`prompt_logprobs` must be 0 or 1 (only the prompt tokens' own logprobs)",
                param="prompt_logprobs",
            )
        for p, ids in enumerate(prompts):
            lps = await asyncio.to_thread(engine.score_prompt, ids)
            entries = [None] + [
                {str(t): {"logprob": lp, "rank": None, "decoded_token": engine.tokens.token_info(t)[0]}}
                for t, lp in zip(ids[1:], lps[1:])
            ]
            for i in range(n):
                resp["choices"][p * n + i]["prompt_logprobs"] = entries

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await _body(request)
        _check_model(state, body)
        check_typed_fields(body)
        if body.get("messages") is not None:
            messages, agp, cont, kwargs = parse_chat_render(body)
            tokens = await asyncio.to_thread(
                engine.tokens.encode_chat, messages, body.get("tools"), agp, cont, kwargs
            )
        elif isinstance(body.get("prompt"), str):
            tokens = await asyncio.to_thread(engine.tokens.encode_text, body["prompt"])
        else:
            raise APIError("/tokenize needs `messages` (a list) or `prompt` (a string)", param="prompt")
        out: dict[str, Any] = {
            "count": len(tokens),
            "max_model_len": engine.max_model_len,
            "tokens": tokens,
            "token_strs": None,
        }
        if _bool(body, "return_token_strs", False):
            out["token_strs"] = [engine.tokens.token_info(t)[0] for t in tokens]
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await _body(request)
        _check_model(state, body)
        tokens = _int_list(body.get("tokens"), "tokens")
        if tokens and (min(tokens) < 0 or max(tokens) >= engine.vocab_size):
            raise APIError(f"token ids must be in [0, {engine.vocab_size})", param="tokens")
        return {"prompt": engine.tokens.decode(tokens, skip_special_tokens=False)}

    # -- admin -----------------------------------------------------------------------------------------
    @app.post("/pause")
    async def pause() -> dict[str, Any]:
        engine.pause()
        return {"status": "paused", "policy_step": engine.policy_step}

    @app.post("/resume")
    async def resume() -> dict[str, Any]:
        engine.resume()
        return {"status": "running", "policy_step": engine.policy_step}

    @app.post("/init_broadcaster")
    async def init_broadcaster(request: Request) -> dict[str, Any]:
        from hpcrl.weights.collective import destroy_group

        body = await _body(request)
        host = guard.check_host(body.get("host"))
        port = _int(body, "port", None, lo=1, hi=65535)
        world = _int(body, "world_size", None, lo=2, hi=MAX_WORLD)
        rank = _int(body, "rank", None, lo=1, hi=MAX_WORLD)
        if port is None or world is None or rank is None:
            raise APIError("/init_broadcaster needs host, port, world_size (>= 2) and rank (>= 1)")
        if rank >= world:
            raise APIError(f"rank {rank} must be < world_size {world}", param="rank")
        receivers = _int(body, "receivers", 1, lo=1)
        if receivers != 1:  # the embedded engine receives in this one process, whatever GPUs it spans
            raise APIError(
                f"this hf server receives weights in 1 process, the group counts it as {receivers}",
                status=409,
                param="receivers",
                type="BroadcastError",
            )
        timeout = protocol_float(body, "timeout", 300.0, 0.0, 3600.0, lo_open=True)  # each collective
        join_timeout = protocol_float(
            body, "join_timeout", state.control_timeout_s, 0.0, 3600.0, lo_open=True
        )
        backend = body.get("backend")
        if backend not in (None, "gloo", "nccl"):
            raise APIError(f"`backend` must be gloo or nccl, got {show(backend)}", param="backend")
        async with state.update_lock:
            if state.group is not None:
                destroy_group(state.group)
                state.group = None
            # Bounded by join_timeout whatever the peer does; 502/504 naming it (hpcrl.inference.peers).
            state.group = await peers.join_weight_group(
                host,
                port,
                world,
                rank,
                backend=backend,
                timeout_s=timeout,
                join_timeout_s=min(join_timeout, timeout),
            )
        return {"status": "ok", "rank": rank, "world_size": world, "backend": state.group.backend}

    @app.post("/update_weights")
    async def update_weights(request: Request) -> dict[str, Any]:
        body = await _body(request)
        step = _int(body, "step", None, lo=0, hi=MAX_STEP)
        if step is None:
            raise APIError("`step` (an integer >= 0) is required", param="step")
        expected = body.get("expected_checksum")
        if expected is not None and not isinstance(expected, str):
            raise APIError("`expected_checksum` must be a string", param="expected_checksum")
        transport = body.get("transport", "path" if body.get("path") is not None else None)
        t0 = time.perf_counter()
        async with state.update_lock:
            if transport == "path":
                if not isinstance(body.get("path"), str):
                    raise APIError("`path` must be a string", param="path")
                guard.check_weights_path(body["path"], state.run_dir, state.allow_any_weights_path)
                try:
                    checksum = await asyncio.to_thread(engine.update_weights_from_path, body["path"], step)
                except Exception as e:
                    if engine.checksum == "unverified":  # a streamed load failed midway: refuse to serve
                        state.sync_error = f"weight update to step {step} failed midway: {e}"
                    raise
                sent = None
            elif transport == "collective":
                if state.group is None:
                    raise APIError(
                        "no weight broadcast group: call /init_broadcaster first",
                        status=409,
                        type="BroadcastError",
                    )
                try:
                    checksum, sent = await asyncio.to_thread(_receive_and_load, state, step)
                except (APIError, EngineError):  # the request's or the engine's refusal, not the broadcast's
                    raise
                except Exception as e:  # sender died, timeout, protocol mismatch
                    raise APIError(
                        f"receiving the weight broadcast failed: {type(e).__name__}: {e}",
                        status=502,
                        type="BroadcastError",
                    ) from e
            else:
                raise APIError('give `path` (a weights dir) or `transport: "collective"`', param="transport")
            problem = None
            if sent is not None and sent != checksum:
                problem = f"loaded checksum {checksum} != sender's {sent}"
            elif expected is not None and expected != checksum:
                problem = f"loaded checksum {checksum} != expected {expected}"
            if problem:
                # The weights are in the model now but cannot be trusted: refuse to generate until a
                # good update arrives, rather than serve a policy nobody asked for.
                state.sync_error = f"weight update to step {step} failed verification: {problem}"
                raise APIError(state.sync_error, status=409, type="WeightSyncError")
            state.sync_error = None
        took = time.perf_counter() - t0
        log.info("loaded policy %d (%s, %s) in %.2f s", step, transport, checksum, took)
        return {
            "step": step,
            "checksum": checksum,
            "seconds": took,
            "num_tensors": engine.weights_info()["num_tensors"],
        }

    async def load_lora(request: Request) -> dict[str, Any]:
        body = await _body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name.isprintable() or not 0 < len(name) <= MAX_LORA_NAME:
            raise APIError(
                f"`lora_name` must be a non-empty printable string of at most {MAX_LORA_NAME} characters, "
                f"got {show(name)}",
                param="lora_name",
            )
        if not isinstance(path, str):
            raise APIError(f"`lora_path` must be a string, got {show(path)}", param="lora_path")
        guard.check_weights_path(path, state.run_dir, state.allow_any_weights_path, param="lora_path")
        step = _int(body, "step", None, lo=0, hi=MAX_STEP)  # as /update_weights: a policy step
        async with state.update_lock:
            checksum = await asyncio.to_thread(engine.load_lora, name, path, step)
        return {"status": "ok", "lora_name": name, "checksum": checksum, "step": engine.policy_step}

    app.add_api_route("/load_lora_adapter", load_lora, methods=["POST"])
    app.add_api_route("/v1/load_lora_adapter", load_lora, methods=["POST"])
    from hpcrl.inference import generate as token_route  # POST /inference/v1/generate

    token_route.install(app, state, read_body=_body, check_model=_check_model, to_json=_json)
    return app


def _receive_and_load(state: ServerState, step: int) -> tuple[str, str | None]:
    from hpcrl.weights.collective import CorruptBucket, receive_header, receive_into, receive_tensors
    from hpcrl.weights.delta import Delta
    from hpcrl.weights.rounds import receive_rounds

    header = receive_header(state.group)
    if header.step != step:  # taken part in (no sender is left hanging), then refused
        receive_rounds(state.group, header, None)
        raise APIError(
            f"the broadcast carried step {header.step}, the request said {step}",
            status=409,
            type="WeightSyncError",
        )
    try:
        if header.delta is None and header.adapter is None:  # bucket by bucket into the parameters
            return (
                state.engine.update_weights_streamed(
                    header.tensors, step, lambda sink, rows: receive_into(state.group, header, sink, rows)
                ),
                header.checksum,
            )
        tensors = receive_tensors(state.group, header)  # small: an adapter or a delta, assembled whole
    except CorruptBucket as e:  # every round was received: no sender is left hanging
        state.sync_error = f"weight update to step {step} failed verification: {e}"
        raise APIError(str(e), status=409, type="WeightSyncError") from e
    except Exception as e:
        if state.engine.checksum == "unverified":  # half written: refuse to generate until a good update
            state.sync_error = f"weight update to step {step} failed midway: {type(e).__name__}: {e}"
        raise
    if header.adapter is not None:  # LoRA RL: merged like /load_lora_adapter, checksum over the adapter
        return (
            state.engine.merge_lora(ADAPTER_NAME, f"broadcast:step_{step}", header.adapter, tensors, step),
            header.checksum,
        )
    try:
        delta = Delta.from_manifest(header.delta, tensors)
    except ValueError as e:
        raise APIError(str(e), status=409, type="WeightSyncError") from e
    return state.engine.apply_delta(delta, step), header.checksum
