"""Fuzzing a real `hpcrl inference` server: every malformed request is a 4xx with a one-line JSON error
naming the field, never a 5xx, a traceback, a hang or a crash, and the next good request succeeds.

One server (the tiny Qwen3-MoE, keyed, 127.0.0.1, a free port) serves the module. The table holds the
requests a fuzz campaign found answered wrongly, one group per finding class:

- engine refusals named in the engine's terms (`prompt`, `max_tokens`), not the field the client wrote;
- `chat_template_kwargs` keys that clash with apply_chat_template's own arguments (blamed on `messages`,
  with Python internals in the message, or silently replacing the template);
- a client's value echoed back whole (a 1 MB string in the error message);
- documented fields of the wrong type, or falsy garbage (`false`, `0`, `""`), accepted silently;
- an admin `step` / `lora_name` out of range, integer / bool tensors loaded as weights;
- an unbounded request body (a 50 MB prompt kept the shared tokenizer busy past any timeout);
- the HTTP parser's refusals answered as text/plain, not the JSON error every route answers with;
- in-range sampling values (top_p / repetition_penalty that are 0 in float32) giving NaN logprobs.

Then a seeded loop of ~200 random mutations (with good requests among them) asserts no 5xx.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.server_proc import start_inference

KEY = "fuzz-test-key-0123456789"
MAX_LEN = 256
MSGS = [{"role": "user", "content": "hi"}]
GOOD = {"messages": MSGS, "max_tokens": 3, "seed": 5, "logprobs": True, "return_token_ids": True}
Q_PROJ = "model.layers.0.self_attn.q_proj"
BIG = "a" * (1 << 20)


class Server:
    def __init__(self, model_dir: str, run_dir: Path):
        self.run_dir = run_dir
        self.proc, self.log, self.url = start_inference(model_dir, run_dir, KEY, MAX_LEN)
        assert self.url.startswith("http://127.0.0.1:"), self.url
        self.port = int(self.url.rsplit(":", 1)[1])
        self.http = httpx.Client(base_url=self.url, timeout=30, headers={"Authorization": f"Bearer {KEY}"})

    def stop(self) -> None:
        self.http.close()
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _files(model_dir: str, run_dir: Path) -> None:
    """Integer tensors where the model has float weights: a weights dir and a LoRA adapter dir."""
    import torch
    from safetensors.torch import load_file, save_file

    w = load_file(os.path.join(model_dir, "model.safetensors"))[f"{Q_PROJ}.weight"]
    (run_dir / "int_weights").mkdir()
    save_file({f"{Q_PROJ}.weight": w.to(torch.int32)}, str(run_dir / "int_weights" / "model.safetensors"))
    lora = run_dir / "int_lora"
    lora.mkdir()
    (lora / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 4}))
    mod = f"base_model.model.{Q_PROJ}"
    save_file(
        {
            f"{mod}.lora_A.weight": torch.zeros(2, w.shape[1], dtype=torch.int32),
            f"{mod}.lora_B.weight": torch.zeros(w.shape[0], 2, dtype=torch.int32),
        },
        str(lora / "adapter_model.safetensors"),
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from hpcrl.models.resolve import resolve_model

    model_dir = resolve_model("hpcrl/tiny-qwen3-moe")
    run_dir = tmp_path_factory.mktemp("fuzz_run")
    _files(model_dir, run_dir)
    s = Server(model_dir, run_dir)
    yield s
    s.stop()


def _good(s: Server) -> None:
    r = s.http.post("/v1/chat/completions", json=GOOD)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] and choice["routed_experts"]  # the MoE's routing comes back too


def _check_error(r: httpx.Response) -> dict[str, Any]:
    """A 4xx whose body is the one-line JSON error (no traceback, not an echo of a huge input)."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert err["code"] == r.status_code and err["type"], err
    msg = err["message"]
    assert msg and "\n" not in msg and "Traceback" not in msg and len(r.content) < 2000, r.text[:500]
    return err


CHAT, COMPLETIONS, GENERATE = "/v1/chat/completions", "/v1/completions", "/inference/v1/generate"
ASSISTANT_LAST = [*MSGS, {"role": "assistant", "content": "he"}]
LORA = {"lora_name": "a", "lora_path": "{run}/nope"}
# (id, route, body, status, field the error must name)
TABLE: list[tuple[str, str, dict[str, Any], int, str]] = [
    # engine refusals named as the client wrote the field
    (
        "max-completion-tokens",
        CHAT,
        {"messages": MSGS, "max_completion_tokens": 10**6},
        400,
        "max_completion_tokens",
    ),
    ("prompt-token-ids-empty", CHAT, {"messages": MSGS, "prompt_token_ids": []}, 400, "prompt_token_ids"),
    (
        "prompt-token-ids-vocab",
        CHAT,
        {"messages": MSGS, "prompt_token_ids": [10**6]},
        400,
        "prompt_token_ids",
    ),
    ("completion-too-long", COMPLETIONS, {"prompt": [5] * (MAX_LEN + 4), "max_tokens": 1}, 400, "prompt"),
    ("stop-token-ids-vocab", CHAT, {"messages": MSGS, "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ("stop-token-ids-neg", COMPLETIONS, {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    # chat_template_kwargs that clash with the template call
    (
        "ctk-messages",
        CHAT,
        {"messages": MSGS, "chat_template_kwargs": {"messages": 5}},
        400,
        "chat_template_kwargs",
    ),
    (
        "ctk-tokenize",
        "/tokenize",
        {"messages": MSGS, "chat_template_kwargs": {"tokenize": True}},
        400,
        "chat_template_kwargs",
    ),
    (
        "ctk-template",
        CHAT,
        {"messages": MSGS, "chat_template_kwargs": {"chat_template": "x"}},
        400,
        "chat_template_kwargs",
    ),
    ("ctk-false", CHAT, {"messages": MSGS, "chat_template_kwargs": False}, 400, "chat_template_kwargs"),
    (
        "continue-and-agp",
        CHAT,
        {"messages": ASSISTANT_LAST, "continue_final_message": True, "add_generation_prompt": True},
        400,
        "continue_final_message",
    ),
    # a 1 MB value is not echoed back
    ("huge-max-tokens", CHAT, {"messages": MSGS, "max_tokens": BIG}, 400, "max_tokens"),
    ("huge-model", CHAT, {"messages": MSGS, "model": BIG}, 404, "model"),
    ("huge-seed-list", CHAT, {"messages": MSGS, "seed": ["s"] * 1000}, 400, "seed"),
    ("huge-lora-name", "/load_lora_adapter", {**LORA, "lora_name": BIG}, 400, "lora_name"),
    # documented fields of the wrong type, falsy garbage
    ("response-format", CHAT, {"messages": MSGS, "response_format": 5}, 400, "response_format"),
    ("response-format-str", COMPLETIONS, {"prompt": "hi", "response_format": "json"}, 400, "response_format"),
    ("tool-choice", CHAT, {"messages": MSGS, "tool_choice": 5}, 400, "tool_choice"),
    ("stream-options", CHAT, {"messages": MSGS, "stream_options": "x"}, 400, "stream_options"),
    ("user", CHAT, {"messages": MSGS, "user": 5}, 400, "user"),
    ("echo", COMPLETIONS, {"prompt": "hi", "echo": "yes"}, 400, "echo"),
    ("best-of", COMPLETIONS, {"prompt": "hi", "best_of": -1}, 400, "best_of"),
    (
        "add-special-tokens",
        "/tokenize",
        {"prompt": "hi", "add_special_tokens": "no"},
        400,
        "add_special_tokens",
    ),
    ("stop-token-ids-false", CHAT, {"messages": MSGS, "stop_token_ids": False}, 400, "stop_token_ids"),
    ("stop-token-ids-obj", COMPLETIONS, {"prompt": "hi", "stop_token_ids": {}}, 400, "stop_token_ids"),
    ("logit-bias-list", CHAT, {"messages": MSGS, "logit_bias": []}, 400, "logit_bias"),
    ("logit-bias-bad-key", CHAT, {"messages": MSGS, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (
        "frequency-penalty-false",
        CHAT,
        {"messages": MSGS, "frequency_penalty": False},
        400,
        "frequency_penalty",
    ),
    (
        "tool-name-int",
        CHAT,
        {"messages": MSGS, "tools": [{"type": "function", "function": {"name": 5}}]},
        400,
        "tools",
    ),
    ("tool-empty", "/tokenize", {"messages": MSGS, "tools": [{}]}, 400, "tools"),
    (
        "tool-parameters-str",
        CHAT,
        {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
        400,
        "tools",
    ),
    (
        "tool-call-arguments-int",
        CHAT,
        {
            "messages": [
                *MSGS,
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]},
            ]
        },
        400,
        "messages",
    ),
    ("message-name-int", CHAT, {"messages": [{"role": "user", "content": "hi", "name": 5}]}, 400, "messages"),
    # admin routes
    ("lora-step-negative", "/load_lora_adapter", {**LORA, "step": -5}, 400, "step"),
    ("lora-step-huge", "/v1/load_lora_adapter", {**LORA, "step": 10**30}, 400, "step"),
    ("lora-step-bool", "/load_lora_adapter", {**LORA, "step": True}, 400, "step"),
    ("lora-name-nul", "/load_lora_adapter", {**LORA, "lora_name": "a\x00"}, 400, "lora_name"),
    (
        "lora-int-tensors",
        "/load_lora_adapter",
        {"lora_name": "a", "lora_path": "{run}/int_lora"},
        400,
        "lora_path",
    ),
    ("weights-int-tensors", "/update_weights", {"step": 1, "path": "{run}/int_weights"}, 400, "path"),
    # the generate route names its own fields too
    (
        "generate-stop-ids",
        GENERATE,
        {"token_ids": [5, 6], "sampling_params": {"stop_token_ids": False}},
        400,
        "sampling_params.stop_token_ids",
    ),
]


def _fill(body: Any, run: str) -> Any:
    if isinstance(body, dict):
        return {k: _fill(v, run) for k, v in body.items()}
    return body.replace("{run}", run) if isinstance(body, str) and "{run}" in body else body


@pytest.mark.parametrize(
    ("route", "body", "status", "field"), [t[1:] for t in TABLE], ids=[t[0] for t in TABLE]
)
def test_found_request_is_a_4xx_naming_the_field(server, route, body, status, field) -> None:
    t0 = time.monotonic()
    r = server.http.post(route, json=_fill(body, str(server.run_dir)))
    assert time.monotonic() - t0 < 30
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = _check_error(r)
    assert field in f"{err['message']} {err['param']}", err
    assert err["param"] is not None and err["param"].split(".")[0] == field.split(".")[0], err
    _good(server)


def test_body_past_the_limit_is_413_at_once(server) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "é🤖" * (3 << 20)}]}).encode()
    t0 = time.monotonic()
    r = server.http.post(CHAT, content=body, headers={"Content-Type": "application/json"})
    assert time.monotonic() - t0 < 10
    assert r.status_code == 413 and "request entity too large" in _check_error(r)["message"], r.text
    _good(server)


def test_parser_refusal_is_a_json_error(server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n")
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, raw[:300]
    assert json.loads(body)["error"]["code"] == 400
    _good(server)


@pytest.mark.parametrize("sampling", [{"repetition_penalty": 1e-40}, {"top_p": 1e-50}])
def test_degenerate_sampling_values_give_finite_logprobs(server, sampling) -> None:
    r = server.http.post(CHAT, json={**GOOD, "max_tokens": 4, "ignore_eos": True, **sampling})
    assert r.status_code == 200, r.text
    lps = [c["logprob"] for c in r.json()["choices"][0]["logprobs"]["content"]]
    assert lps and all(isinstance(x, float) and math.isfinite(x) and x <= 0 for x in lps), lps
    if "top_p" in sampling:  # only the likeliest token is left: it is drawn with probability 1
        assert lps == [0.0] * len(lps)


# -- seeded fuzz loop ------------------------------------------------------------------------------------
BASES: dict[str, dict[str, Any]] = {
    CHAT: {**GOOD, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "n": 2, "stop": ["x"], "tools": []},
    COMPLETIONS: {"prompt": "hi", "max_tokens": 3, "logprobs": 2, "n": 1, "seed": 3, "echo": False},
    "/tokenize": {"messages": MSGS, "add_generation_prompt": True, "chat_template_kwargs": {}},
    "/detokenize": {"tokens": [5, 6, 7]},
    GENERATE: {"token_ids": [5, 17, 42], "sampling_params": {"max_tokens": 3, "logprobs": 1, "seed": 2}},
    "/update_weights": {"step": 1, "path": "{run}/nope"},
    "/load_lora_adapter": dict(LORA),
}


def _junk(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value no field takes as it is (nested up to 3 deep)."""
    makers = [
        lambda: None,
        lambda: rng.choice([True, False]),
        lambda: rng.choice([0, -1, 1, 10**9, 10**30, -(10**30), 2**63]),
        lambda: rng.choice([1.5, -0.5, 1e308, 1e-320, float("nan"), float("inf")]),
        lambda: rng.choice(["", "x", "\x00\x1b[31m\n", "héllo 🤖\u202e", "a" * 10000, "5"]),
        lambda: [rng.randrange(-5, 10**6) for _ in range(rng.randrange(4))],
        lambda: ["s"] * rng.randrange(50),
        lambda: {},
        lambda: [[1], [-1]],
        lambda: [_junk(rng, depth + 1) for _ in range(rng.randrange(3))],
        lambda: {rng.choice(["role", "content", "type", "name", "x"]): _junk(rng, depth + 1)},
        lambda: [{"role": rng.choice(["user", "tool", "wizard"]), "content": _junk(rng, depth + 1)}],
    ]
    return makers[rng.randrange(len(makers) if depth < 2 else 9)]()


def _mutant(rng: random.Random, run: str) -> tuple[str, bytes]:
    route = rng.choice(list(BASES))
    body = _fill(BASES[route], run)
    if rng.random() < 0.08:
        return route, rng.choice([b"", b"[1]", b'"x"', b"null", b"{", b"\xff\xfe", b'{"a":' * 80])
    for _ in range(rng.randrange(1, 3)):
        keys = [*body, "extra_field"]
        if route == GENERATE and isinstance(body["sampling_params"], dict) and rng.random() < 0.5:
            sp = dict(body["sampling_params"])
            sp[rng.choice([*sp, "n", "top_p", "stop", "routed_experts_prompt_start", "min_tokens"])] = _junk(
                rng
            )
            body["sampling_params"] = sp
        else:
            body[rng.choice(keys)] = _junk(rng)
    return route, json.dumps(body).encode()


def test_seeded_fuzz_never_5xx_and_the_server_keeps_serving(server) -> None:
    rng = random.Random(20240611)
    cases = [_mutant(rng, str(server.run_dir)) for _ in range(200)]
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    async def run() -> list[tuple[str, bytes, int, str]]:
        bad: list[tuple[str, bytes, int, str]] = []
        sem = asyncio.Semaphore(12)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, headers=headers) as c:

            async def one(route: str, content: bytes) -> None:
                async with sem:
                    r = await c.post(route, content=content)
                ok = r.status_code < 500
                if ok and r.status_code >= 400:
                    try:
                        _check_error(r)
                    except AssertionError:
                        ok = False
                if not ok:
                    bad.append((route, content[:200], r.status_code, r.text[:300]))

            async def good() -> None:
                async with sem:
                    r = await c.post(CHAT, json=GOOD)
                if r.status_code != 200:
                    bad.append((CHAT, b"<good>", r.status_code, r.text[:300]))

            jobs = [one(route, content) for route, content in cases]
            jobs += [good() for _ in range(20)]
            rng.shuffle(jobs)
            await asyncio.gather(*jobs)
        return bad

    t0 = time.monotonic()
    bad = asyncio.run(run())
    assert not bad, bad[:5]
    assert time.monotonic() - t0 < 60
    assert server.proc.poll() is None
    assert server.http.get("/health").json()["status"] == "ok"
    _good(server)
