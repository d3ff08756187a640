"""OpenAI/vLLM request parsing and response shapes for the embedded backend (pure Python).

Everything a client can get wrong is checked here and raised as `APIError`, which the server turns into
`{"error": {"message", "type", "param", "code"}}` with a 4xx status: bad input never reaches the engine.
Unknown request fields are ignored, as vLLM does; the OpenAI/vLLM fields this backend does not use
(`user`, `response_format`, `tool_choice`, ...) are still type-checked (TYPED_FIELDS), as vLLM's
request models check them. Error messages are one bounded line (`one_line`, `show`).
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hpcrl.inference.content import ContentError, message_content

MAX_N = 128
MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**63 - 1 - MAX_N  # choice i draws from seed + i: every one must fit a torch generator seed
MAX_MESSAGE_CHARS = 1000  # an error message longer than this is cut (a 1 MB value is never echoed back)
_SHOWN = 60  # characters of a client's value quoted in an error message
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def one_line(message: object, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`message` as one bounded line: line breaks and other control characters (from an exception's
    text, a template error, a client's value) become spaces, and the line is cut at `limit`."""
    text = " ".join(_CONTROL.sub(" ", str(message)).split())
    if len(text) > limit:
        text = f"{text[: limit - 30]}... ({len(text)} chars in all)"
    return text


def show(v: Any) -> str:
    """A client's value quoted in an error message: its repr, cut when long."""
    r = repr(v)
    return r if len(r) <= _SHOWN else f"{r[: _SHOWN - 10]}... ({len(r)} chars)"


class APIError(Exception):
    """A request the server refuses, with the HTTP status and OpenAI error fields to answer with.

    Every error answer of the embedded server is built here (engine refusals, HTTP errors, internal
    errors too), so `message` is made one bounded line here, whatever produced it."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "BadRequestError",
        param: str | None = None,
        code: int | None = None,
    ):
        message = one_line(message)
        super().__init__(message)
        self.message, self.status, self.type, self.param = message, status, type, param
        self.code = code if code is not None else status

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def not_found(message: str, param: str | None = None) -> APIError:
    return APIError(message, status=404, type="NotFoundError", param=param)


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = None  # None: up to the context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False


# -- field readers -------------------------------------------------------------------------------------
def _int(
    body: dict[str, Any], key: str, default: int | None, lo: int | None = None, hi: int | None = None
) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise APIError(f"`{key}` must be an integer, got {show(v)}", param=key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise APIError(f"`{key}` must be {rng}, got {show(v)}", param=key)
    return v


def _float(
    body: dict[str, Any], key: str, default: float, lo: float, hi: float, lo_open: bool = False
) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or v != v:
        raise APIError(f"`{key}` must be a number, got {show(v)}", param=key)
    if v > hi or v < lo or (lo_open and v == lo):
        raise APIError(f"`{key}` must be in {'(' if lo_open else '['}{lo}, {hi}], got {show(v)}", param=key)
    return float(v)


def _bool(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(f"`{key}` must be a boolean, got {show(v)}", param=key)
    return v


def _or(v: Any, default: Any) -> Any:
    """`v`, or `default` when the field is unset (null): never for a falsy value of the wrong type."""
    return default if v is None else v


def _int_list(v: Any, key: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise APIError(f"`{key}` must be a list of integers", param=key)
    return list(v)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _int_at_least(lo: int) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= lo


def _list_of(kind: type) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(isinstance(x, kind) and not isinstance(x, bool) for x in v)


def _typed_object(v: Any) -> bool:
    return isinstance(v, dict) and isinstance(v.get("type"), str)


# OpenAI / vLLM request fields this backend does not read (or only refuses when set): their JSON type
# is still checked, as vLLM's request models check it, so a malformed one is a 400 naming the field
# rather than silently ignored. Well-typed values keep being accepted (or refused below) as before;
# null is always allowed (the field unset). Fields read elsewhere (n, seed, stop, ...) check their own.
TYPED_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "user": ("a string", lambda v: isinstance(v, str)),
    "metadata": ("an object", lambda v: isinstance(v, dict)),
    "store": ("a boolean", lambda v: isinstance(v, bool)),
    "service_tier": ("a string", lambda v: isinstance(v, str)),
    "reasoning_effort": ("a string", lambda v: isinstance(v, str)),
    "parallel_tool_calls": ("a boolean", lambda v: isinstance(v, bool)),
    "stream_options": ("an object", lambda v: isinstance(v, dict)),
    "tool_choice": (
        '"none", "auto", "required" or an object with a string `type`',
        lambda v: v in ("none", "auto", "required") or _typed_object(v),
    ),
    "response_format": ("an object with a string `type`", _typed_object),
    "echo": ("a boolean", lambda v: isinstance(v, bool)),
    "best_of": ("an integer >= 1", _int_at_least(1)),
    "use_beam_search": ("a boolean", lambda v: isinstance(v, bool)),
    "min_tokens": ("an integer >= 0", _int_at_least(0)),
    "length_penalty": ("a finite number", _number),
    "suffix": ("a string", lambda v: isinstance(v, str)),
    "prompt_logprobs": ("an integer >= 0", _int_at_least(0)),
    "add_special_tokens": ("a boolean", lambda v: isinstance(v, bool)),
    "documents": ("a list of objects", lambda v: isinstance(v, list) and all(isinstance(d, dict) for d in v)),
    "chat_template": ("a string", lambda v: isinstance(v, str)),
    "priority": ("an integer", _int_at_least(-(2**63))),
    "request_id": ("a string", lambda v: isinstance(v, str)),
    "cache_salt": ("a string", lambda v: isinstance(v, str)),
    "kv_transfer_params": ("an object", lambda v: isinstance(v, dict)),
    "return_tokens_as_token_ids": ("a boolean", lambda v: isinstance(v, bool)),
    "spaces_between_special_tokens": ("a boolean", lambda v: isinstance(v, bool)),
    "truncate_prompt_tokens": ("an integer >= -1", _int_at_least(-1)),
    "guided_json": ("a string or an object", lambda v: isinstance(v, str | dict)),
    "guided_regex": ("a string", lambda v: isinstance(v, str)),
    "guided_choice": ("a list of strings", _list_of(str)),
    "guided_grammar": ("a string", lambda v: isinstance(v, str)),
    "structured_outputs": ("an object", lambda v: isinstance(v, dict)),
    "bad_words": ("a list of strings", _list_of(str)),
    "allowed_token_ids": ("a list of integers", _list_of(int)),
    "logit_bias": ("an object", lambda v: isinstance(v, dict)),
    "frequency_penalty": ("a finite number", _number),
    "presence_penalty": ("a finite number", _number),
}


def check_typed_fields(body: dict[str, Any]) -> None:
    """400 naming the first field of TYPED_FIELDS whose value has the wrong JSON type."""
    for key, (kind, ok) in TYPED_FIELDS.items():
        v = body.get(key)
        if v is not None and not ok(v):
            raise APIError(f"`{key}` must be {kind}, got {show(v)}", param=key)


def parse_sampling(body: dict[str, Any], *, chat: bool) -> SamplingParams:
    """Read and validate the sampling fields of a chat or completions request."""
    if _bool(body, "stream", False):
        raise APIError("`stream` is not supported by the hf backend; send stream=false", param="stream")
    check_typed_fields(body)
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise APIError(f"`{key}` is not supported by the hf backend (use repetition_penalty)", param=key)
    if body.get("logit_bias"):
        raise APIError("`logit_bias` is not supported by the hf backend", param="logit_bias")
    max_tokens = _int(body, "max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None, lo=1)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
        raise APIError("`stop` must be a non-empty string or a list of at most 16 of them", param="stop")
    top_k = _int(body, "top_k", 0, lo=-1)
    if chat:
        logprobs = _bool(body, "logprobs", False)
        top_logprobs = _int(body, "top_logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS) or 0
        if top_logprobs and not logprobs:
            raise APIError("`top_logprobs` needs `logprobs: true`", param="top_logprobs")
    else:  # completions: `logprobs` is the number of alternatives (0 = only the sampled token)
        lp = body.get("logprobs")
        if isinstance(lp, bool):
            lp = 0 if lp else None
        logprobs = lp is not None
        top_logprobs = _int({"logprobs": lp}, "logprobs", 0, lo=0, hi=MAX_TOP_LOGPROBS) or 0
    return SamplingParams(
        n=_int(body, "n", 1, lo=1, hi=MAX_N) or 1,
        max_tokens=max_tokens,
        temperature=_float(body, "temperature", 1.0, 0.0, 100.0),
        top_p=_float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=max(top_k or 0, 0),
        min_p=_float(body, "min_p", 0.0, 0.0, 1.0),
        repetition_penalty=_float(body, "repetition_penalty", 1.0, 0.0, 100.0, lo_open=True),
        stop=stop,
        stop_token_ids=_int_list(_or(body.get("stop_token_ids"), []), "stop_token_ids"),
        seed=_int(body, "seed", None, lo=0, hi=MAX_SEED),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        ignore_eos=_bool(body, "ignore_eos", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        return_token_ids=_bool(body, "return_token_ids", False),
    )


# -- prompts -------------------------------------------------------------------------------------------
# Message fields a chat template reads as text.
MESSAGE_STRINGS = ("name", "tool_call_id", "reasoning_content", "reasoning")
# apply_chat_template's own arguments and what it renders the template with: a `chat_template_kwargs`
# key among them would clash with (or replace) what the server passes.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def parse_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Validate `messages` and normalise content to strings (what the chat template expects)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("`messages` must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(f"messages[{i}] must be an object with a string `role`", param="messages")
        if m["role"] not in ("system", "user", "assistant", "tool", "developer"):
            raise APIError(f"messages[{i}]: unknown role {m['role']!r}", param="messages")
        msg = dict(m)
        msg["role"] = "system" if m["role"] == "developer" else m["role"]
        try:
            msg["content"] = message_content(m.get("content"), f"messages[{i}]")
        except ContentError as e:
            raise APIError(str(e), param="messages") from None
        for key in MESSAGE_STRINGS:
            if m.get(key) is not None and not isinstance(m[key], str):
                raise APIError(f"messages[{i}].{key} must be a string, got {show(m[key])}", param="messages")
        calls = m.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
                raise APIError(f"messages[{i}].tool_calls must be a list of objects", param="messages")
            msg["tool_calls"] = [_normalise_tool_call(c, i) for c in calls]
        out.append(msg)
    _check_tools(body.get("tools"))
    return out


def _check_tools(tools: Any) -> None:
    """OpenAI's `tools`: a list of {"type": "function", "function": {"name", "description"?,
    "parameters"?}} (the function's fields at the top level are taken too)."""
    if tools is None:
        return
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise APIError("`tools` must be a list of objects", param="tools")
    for j, tool in enumerate(tools):
        if tool.get("type") not in (None, "function") and "function" not in tool:
            continue  # another kind of tool (e.g. "custom"): the template renders it as given
        fn = tool.get("function", tool)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(f"tools[{j}] needs function.name (a non-empty string)", param="tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise APIError(f"tools[{j}].function.parameters must be an object (a JSON schema)", param="tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise APIError(f"tools[{j}].function.description must be a string", param="tools")


def parse_chat_render(body: dict[str, Any]) -> tuple[list[dict[str, Any]], bool, bool, dict[str, Any]]:
    """What the chat template renders a request's messages with: (messages, add_generation_prompt,
    continue_final_message, chat_template_kwargs). /v1/chat/completions and /tokenize must agree, or a
    client's /tokenize count would not be the prompt it is charged for."""
    messages = parse_messages(body)
    cont = _bool(body, "continue_final_message", False)
    agp = _bool(body, "add_generation_prompt", not cont)
    if cont and agp:
        raise APIError(
            "`continue_final_message` and `add_generation_prompt` cannot both be true",
            param="continue_final_message",
        )
    kwargs = _or(body.get("chat_template_kwargs"), {})
    if not isinstance(kwargs, dict):
        raise APIError("`chat_template_kwargs` must be an object", param="chat_template_kwargs")
    clash = sorted(RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if clash:
        raise APIError(
            f"`chat_template_kwargs.{clash[0]}` is not allowed: the server sets it "
            f"(not allowed there: {', '.join(sorted(RESERVED_TEMPLATE_KWARGS))})",
            param=f"chat_template_kwargs.{clash[0]}",
        )
    return messages, agp, cont, kwargs


def _normalise_tool_call(call: dict[str, Any], i: int) -> dict[str, Any]:
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise APIError(f"messages[{i}].tool_calls: each call needs function.name", param="messages")
    args = fn.get("arguments", {})
    if args is None:
        args = {}
    if not isinstance(args, str | dict):
        raise APIError(
            f"messages[{i}].tool_calls: function.arguments must be a JSON string or an object, "
            f"got {show(args)}",
            param="messages",
        )
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise APIError(
            f"messages[{i}].tool_calls: `id` must be a string, got {show(call['id'])}", param="messages"
        )
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass  # keep the string: the template renders it verbatim
    return {"type": "function", "id": call.get("id"), "function": {"name": fn["name"], "arguments": args}}


def parse_completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """`prompt`: a string, a list of token ids, or a batch of either."""
    p = body.get("prompt")
    if isinstance(p, str):
        return [p]
    if isinstance(p, list) and p:
        if all(isinstance(x, int) and not isinstance(x, bool) for x in p):
            return [list(p)]
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, list) for x in p):
            return [_int_list(x, "prompt") for x in p]
    raise APIError(
        "`prompt` must be a string, a list of token ids, or a non-empty batch of either", param="prompt"
    )


# -- tool calls ----------------------------------------------------------------------------------------
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def extract_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes/Qwen style: <tool_call>{"name": ..., "arguments": ...}</tool_call> → OpenAI tool_calls."""
    calls = []
    for m in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
    if not calls:
        return text, []
    rest = _TOOL_CALL.sub("", text).strip()
    return (rest or None), calls


# -- responses -----------------------------------------------------------------------------------------
@dataclass
class SeqOutput:
    """One finished choice as the engine reports it."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    text: str
    finish_reason: str
    stop_reason: str | int | None
    policy_steps: list[int]
    routed_experts: list[list[list[int]]] | None = None  # MoE: per completion token [layers][k], -1 unknown
    prompt_routed_experts: list[list[list[int]]] | None = None  # MoE: per prompt token (the prefill's)


def _usage(prompt_tokens: int, outs: list[SeqOutput]) -> dict[str, int]:
    completion = sum(len(o.token_ids) for o in outs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }


def chat_logprobs(out: SeqOutput, token_str: Any, token_bytes: Any) -> dict[str, Any]:
    content = []
    for j, (tid, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        tops = out.top_logprobs[j] if out.top_logprobs else []
        content.append(
            {
                "token": token_str(tid),
                "logprob": lp,
                "bytes": token_bytes(tid),
                "top_logprobs": [
                    {"token": token_str(t), "logprob": x, "bytes": token_bytes(t)} for t, x in tops
                ],
            }
        )
    return {"content": content}


def chat_response(
    model: str,
    prompt_ids: list[int],
    outs: list[SeqOutput],
    params: SamplingParams,
    parse_tools: bool,
    token_str: Any,
    token_bytes: Any,
) -> dict[str, Any]:
    choices = []
    for i, o in enumerate(outs):
        message: dict[str, Any] = {"role": "assistant", "content": o.text}
        finish = o.finish_reason
        if parse_tools:
            content, calls = extract_tool_calls(o.text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls" if finish == "stop" else finish
        choice: dict[str, Any] = {
            "index": i,
            "message": message,
            "finish_reason": finish,
            "stop_reason": o.stop_reason,
            "logprobs": chat_logprobs(o, token_str, token_bytes) if params.logprobs else None,
            "policy_steps": o.policy_steps,
        }
        if params.return_token_ids:
            choice["token_ids"] = o.token_ids
            if o.routed_experts is not None:
                choice["routed_experts"] = o.routed_experts
            if o.prompt_routed_experts is not None:  # hpcrl's own: the prompt's routes (prefill)
                choice["prompt_routed_experts"] = o.prompt_routed_experts
        choices.append(choice)
    resp: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(len(prompt_ids), outs),
        "policy_steps": sorted({s for o in outs for s in o.policy_steps}),
    }
    if params.return_token_ids:
        resp["prompt_token_ids"] = prompt_ids
    return resp


def completion_response(
    model: str, prompts: list[list[int]], outs: list[list[SeqOutput]], params: SamplingParams, token_str: Any
) -> dict[str, Any]:
    choices = []
    for p, (prompt_ids, group) in enumerate(zip(prompts, outs)):
        for i, o in enumerate(group):
            lps = None
            if params.logprobs:
                tops = o.top_logprobs or [[] for _ in o.token_ids]
                lps = {
                    "tokens": [token_str(t) for t in o.token_ids],
                    "token_logprobs": o.logprobs,
                    "top_logprobs": [{token_str(t): x for t, x in tk} for tk in tops],
                    "text_offset": [],
                }
            choice: dict[str, Any] = {
                "index": p * params.n + i,
                "text": o.text,
                "logprobs": lps,
                "finish_reason": o.finish_reason,
                "stop_reason": o.stop_reason,
                "policy_steps": o.policy_steps,
            }
            if params.return_token_ids:
                choice["token_ids"] = o.token_ids
                choice["prompt_token_ids"] = prompt_ids
                if o.routed_experts is not None:
                    choice["routed_experts"] = o.routed_experts
                if o.prompt_routed_experts is not None:  # hpcrl's own: the prompt's routes (prefill)
                    choice["prompt_routed_experts"] = o.prompt_routed_experts
            choices.append(choice)
    flat = [o for g in outs for o in g]
    resp: dict[str, Any] = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage(sum(len(p) for p in prompts), flat),
        "policy_steps": sorted({s for o in flat for s in o.policy_steps}),
    }
    if params.return_token_ids and len(prompts) == 1:
        resp["prompt_token_ids"] = prompts[0]
    return resp
