"""`POST /inference/v1/generate`: vLLM's token-in/token-out route on the embedded engine.

Request (vLLM's `GenerateRequest`): `{model, token_ids, sampling_params}`; the prompt is the ids as
given, never re-tokenized, so a multi-turn client that bridges its token stream (renderers'
`bridge_to_next_turn`) gets exactly the continuation it asked for. Response (vLLM's
`GenerateTokensResponse`, output_mode "tokens"): `request_id`, `model`, `created`,
`prompt_token_ids`, `usage`, and per choice `token_ids`, `logprobs`, `finish_reason`, `stop_reason`
and `routed_experts`. Each logprob entry carries vLLM 0.33's `token_id`/`rank` and also
`token: "token_id:<id>"` (the chat shape renderers 0.1.12's client checks).

Every refusal is a 400 naming the field (`token_ids`, `sampling_params.<key>`); nothing reaches the
engine before the whole request is valid, so a bad request changes nothing for the next one.
Self-contained on purpose: api.py only registers it (`install`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from hpcrl.inference.errors import EngineError, for_field
from hpcrl.inference.protocol import (
    MAX_TOP_LOGPROBS,
    APIError,
    SamplingParams,
    SeqOutput,
    parse_sampling,
    show,
)

# The engine's names for what it checks -> this route's fields.
ENGINE_FIELDS = {
    "prompt": "token_ids",
    "max_tokens": "sampling_params.max_tokens",
    "stop_token_ids": "sampling_params.stop_token_ids",
}

ROUTE = "/inference/v1/generate"
# Debugging and the token-exactness test: every answered request appended to this file as one JSON
# line {"prompt_token_ids", "token_ids": [per choice], "logprobs": [per choice]} (what was sampled).
LOG_ENV = "HPCRL_GENERATE_LOG"

# vLLM SamplingParams fields the embedded engine honours (passed on to `parse_sampling`).
SUPPORTED = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "max_tokens",
    "stop",
    "stop_token_ids",
    "seed",
    "logprobs",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
)
# vLLM's "skip this many prompt positions in routed_experts" (verifiers sends it on bridged turns):
# validated as vLLM does; the answer's `start` says where its rows begin.
PROMPT_START = "routed_experts_prompt_start"
# vLLM fields accepted only at the value that changes nothing here (a client may send vLLM's defaults).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "min_tokens": (0,),
    "prompt_logprobs": (None,),
    "detokenize": (True, False),  # token ids are the answer either way
    "spaces_between_special_tokens": (True,),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "flat_logprobs": (False,),
    "output_kind": (None, 0),
    "extra_args": (None, {}),
    "structured_outputs": (None,),
}
# Request fields besides token_ids/sampling_params that vLLM defines; only their neutral values.
NEUTRAL_TOP: dict[str, tuple[Any, ...]] = {
    "stream": (None, False),
    "features": (None,),
    "cache_salt": (None,),  # no prefix cache to salt
    "priority": (None, 0),
    "kv_transfer_params": (None,),
    "request_id": (None,),
    "stream_options": (None,),
    "output_mode": (None, "tokens"),  # "text"/"derender" need vLLM's parsers
    "return_token_ids": (None, True, False),  # prompt_token_ids are always returned
    "reasoning_ended": (None, True, False),  # only gates structured outputs, which the engine lacks
    "reasoning_parser_kwargs": (None,),
    "parse_context": (None,),
    "content_parts": (None, []),
    "token_offsets": (None,),
    "ec_transfer_params": (None,),
}


def parse_request(
    body: dict[str, Any], vocab_size: int, max_model_len: int
) -> tuple[list[int], SamplingParams, int]:
    """Validate a generate request; returns (prompt ids, sampling params, routed_experts_prompt_start)
    or raises APIError (400)."""
    for key, ok in NEUTRAL_TOP.items():
        if key in body and not _neutral(body[key], ok):
            raise APIError(f"`{key}` is not supported by the hf backend", param=key)
    if key := next(
        (k for k in body if k not in ("model", "token_ids", "sampling_params", *NEUTRAL_TOP)), None
    ):
        raise APIError(f"unknown field `{key}`", param=key)
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise APIError("`token_ids` must be a list of integers", param="token_ids")
    if not ids:
        raise APIError("`token_ids` is empty: the prompt needs at least one token", param="token_ids")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(
            f"`token_ids` holds {bad}, outside the vocabulary [0, {vocab_size})", param="token_ids"
        )
    if len(ids) >= max_model_len:
        raise APIError(
            f"`token_ids` has {len(ids)} tokens; this model's maximum context length is {max_model_len} "
            "(prompt plus at least one generated token)",
            param="token_ids",
        )
    sp = body.get("sampling_params")
    start = (
        sp.get(PROMPT_START, 0) if isinstance(sp, dict) else 0
    )  # a non-dict fails in parse_sampling_params
    if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < len(ids):
        raise APIError(
            f"`sampling_params.{PROMPT_START}` must be an integer in [0, {len(ids)}) (the prompt's length), "
            f"got {show(start)}",
            param=f"sampling_params.{PROMPT_START}",
        )
    params = parse_sampling_params(body.get("sampling_params"), vocab_size)
    room = max_model_len - len(ids)
    if params.max_tokens is None or params.max_tokens > room:
        params.max_tokens = room  # vLLM's engine too stops at the context end (finish_reason "length")
    return list(ids), params, start


def parse_sampling_params(sp: Any, vocab_size: int) -> SamplingParams:
    if sp is None:
        sp = {}
    if not isinstance(sp, dict):
        raise APIError("`sampling_params` must be an object", param="sampling_params")
    for key, value in sp.items():
        if key in SUPPORTED or key == PROMPT_START:
            continue
        if key in NEUTRAL:
            if not _neutral(value, NEUTRAL[key]):
                raise APIError(
                    f"`sampling_params.{key}` is not supported by the hf backend "
                    f"(only {' or '.join(repr(v) for v in NEUTRAL[key])})",
                    param=f"sampling_params.{key}",
                )
            continue
        raise APIError(
            f"unknown field `sampling_params.{key}`; supported: {', '.join(SUPPORTED)}",
            param=f"sampling_params.{key}",
        )
    lp = sp.get("logprobs")  # vLLM: None = no logprobs, k >= 0 = the sampled token's + top k
    if lp is not None and (
        isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_TOP_LOGPROBS
    ):
        raise APIError(
            f"`sampling_params.logprobs` must be an integer in [0, {MAX_TOP_LOGPROBS}] or null, got {show(lp)}",
            param="sampling_params.logprobs",
        )
    chat_body = {k: v for k, v in sp.items() if k in SUPPORTED and k != "logprobs"}
    chat_body.update(logprobs=lp is not None, top_logprobs=lp or 0)
    try:
        params = parse_sampling(chat_body, chat=True)
    except APIError as e:  # name the field where the client wrote it
        field = f"sampling_params.{e.param}" if e.param else "sampling_params"
        raise APIError(e.message.replace(f"`{e.param}`", f"`{field}`"), param=field) from None
    bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(
            f"`sampling_params.stop_token_ids` holds {bad}, outside the vocabulary [0, {vocab_size})",
            param="sampling_params.stop_token_ids",
        )
    params.return_token_ids = True
    return params


def _neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed)


def routed_experts(out: SeqOutput, prompt_len: int, start: int) -> dict[str, Any] | None:
    """A choice's expert routing in the shape renderers' and verifiers 0.4's clients read
    (``hpcrl.inference.routed``): one row per position from ``start`` (the request's
    ``routed_experts_prompt_start``): the prompt's from the prefill, then one per completion token,
    -1 for the last (never fed back; vLLM leaves that row out). None for a dense model. Without the
    prefill's rows (not recorded), rows start at the completion and ``start`` says so."""
    if out.routed_experts is None:
        return None
    import numpy as np

    from hpcrl.inference.routed import encode

    done = np.asarray(out.routed_experts, dtype=np.int16)
    if out.prompt_routed_experts is None or len(out.prompt_routed_experts) != prompt_len:
        return encode(done, start=prompt_len)
    prompt = np.asarray(out.prompt_routed_experts, dtype=np.int16)[start:]
    return encode(np.concatenate([prompt, done.reshape(-1, *prompt.shape[1:])]), start=start)


def _logprob(token_id: int, logprob: float) -> dict[str, Any]:
    """One logprob entry in both shapes clients read: vLLM 0.33's tokens mode (`token_id`, `rank`) and
    the chat shape with `--return-tokens-as-token-ids` (`token: "token_id:N"`), which renderers 0.1.12
    checks token by token."""
    return {
        "token_id": token_id,
        "token": f"token_id:{token_id}",
        "logprob": logprob,
        "rank": None,
        "bytes": None,
    }


def response(
    model: str, prompt: list[int], outs: list[SeqOutput], params: SamplingParams, start: int = 0
) -> dict[str, Any]:
    """vLLM's GenerateResponse for `outs`, with the prompt ids (what renderers' client reads back)."""
    choices = []
    for i, o in enumerate(outs):
        logprobs = None
        if params.logprobs:
            tops = o.top_logprobs or [[] for _ in o.token_ids]
            logprobs = {
                "content": [
                    # as vLLM 0.33: the sampled token first, then the top k (k or k + 1 entries)
                    {
                        **_logprob(t, lp),
                        "top_logprobs": [_logprob(t, lp)] + [_logprob(a, x) for a, x in top if a != t],
                    }
                    for t, lp, top in zip(o.token_ids, o.logprobs, tops)
                ]
            }
        choices.append(
            {
                "index": i,
                "token_ids": o.token_ids,
                "logprobs": logprobs,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
                "routed_experts": routed_experts(o, len(prompt), start),
                "policy_steps": o.policy_steps,
            }
        )
    completion = sum(len(o.token_ids) for o in outs)
    return {
        "request_id": uuid.uuid4().hex,
        "output_mode": "tokens",
        "model": model,
        "created": int(time.time()),
        "prompt_token_ids": prompt,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": completion,
            "total_tokens": len(prompt) + completion,
        },
        "prompt_logprobs": None,
        "kv_transfer_params": None,
        "policy_steps": sorted({s for o in outs for s in o.policy_steps}),
    }


def log_sample(path: str, prompt: list[int], outs: list[SeqOutput]) -> None:
    line = {
        "prompt_token_ids": prompt,
        "token_ids": [o.token_ids for o in outs],
        "logprobs": [o.logprobs for o in outs],
    }
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(line, separators=(",", ":")) + "\n").encode())
    finally:
        os.close(fd)


def install(
    app: FastAPI,
    state: Any,
    *,
    read_body: Callable[[Request], Awaitable[dict[str, Any]]],
    check_model: Callable[[Any, dict[str, Any]], str],
    to_json: Callable[[dict[str, Any]], Response],
) -> None:
    """Register the route on the embedded server's app (auth comes from the app's middleware)."""
    engine = state.engine
    log_path = os.environ.get(LOG_ENV)

    async def generate(request: Request) -> Response:
        body = await read_body(request)
        model = check_model(state, body)
        prompt, params, start = parse_request(body, engine.vocab_size, engine.max_model_len)
        if state.sync_error:
            raise APIError(state.sync_error, status=503, type="WeightSyncError")
        try:
            fut = engine.submit(prompt, params)
        except EngineError as e:
            raise for_field(e, ENGINE_FIELDS) from None
        outs = await asyncio.wrap_future(fut)
        if log_path:
            log_sample(log_path, prompt, outs)
        return to_json(response(model, prompt, outs, params, start))

    app.add_api_route(ROUTE, generate, methods=["POST"])
