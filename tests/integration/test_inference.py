"""The hf inference server over real HTTP: sampling, logprobs, batching, robustness, OpenAI client."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")

MSGS = [{"role": "user", "content": "Reverse: hello world"}]
# Logprobs from the server's batched, left-padded, KV-cached decode vs one plain forward pass over the
# same tokens in fp32: they differ only by float reassociation.
LOGPROB_ATOL = 1e-4


def post(server, path: str, body: object, **kw) -> httpx.Response:
    content = body if isinstance(body, str | bytes) else json.dumps(body)
    return httpx.post(f"{server.base_url}{path}", content=content, timeout=60, **kw)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def reference_logprobs(
    model, prompt: list[int], completion: list[int], temperature: float = 1.0, top_k: int = 0
) -> list[float]:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    if top_k:
        kth = torch.topk(logits, top_k, dim=1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)
    lp = torch.log_softmax(logits, dim=1)
    return lp.gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1).tolist()


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_k": 20}])
def test_logprobs_equal_a_direct_forward_pass(inference_server, model, sampling) -> None:
    r = post(
        inference_server,
        "/v1/chat/completions",
        {
            "messages": MSGS,
            "max_tokens": 12,
            "n": 3,
            "logprobs": True,
            "return_token_ids": True,
            "ignore_eos": True,
            **sampling,
        },
    )
    assert r.status_code == 200, r.text
    data = r.json()
    prompt = data["prompt_token_ids"]
    assert len(data["choices"]) == 3
    for choice in data["choices"]:
        toks = choice["token_ids"]
        got = [c["logprob"] for c in choice["logprobs"]["content"]]
        assert len(toks) == len(got) == 12
        want = reference_logprobs(
            model, prompt, toks, sampling.get("temperature", 1.0), sampling.get("top_k", 0)
        )
        assert max(abs(a - b) for a, b in zip(got, want)) < LOGPROB_ATOL
        assert choice["policy_steps"] == [0]
        entry = choice["logprobs"]["content"][0]
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and entry["top_logprobs"] == []


def test_tokenize_matches_the_chat_prompt(inference_server) -> None:
    tok = post(inference_server, "/tokenize", {"messages": MSGS, "add_generation_prompt": True}).json()
    chat = post(
        inference_server,
        "/v1/chat/completions",
        {"messages": MSGS, "max_tokens": 2, "return_token_ids": True},
    ).json()
    assert tok["tokens"] == chat["prompt_token_ids"] and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == 2048
    models = httpx.get(f"{inference_server.base_url}/v1/models").json()["data"]
    assert models[0]["max_model_len"] == 2048


def test_seed_reproduces_a_completion(inference_server) -> None:
    body = {"messages": MSGS, "max_tokens": 16, "seed": 1234, "return_token_ids": True, "ignore_eos": True}
    a, b = (post(inference_server, "/v1/chat/completions", body).json() for _ in range(2))
    c = post(inference_server, "/v1/chat/completions", {**body, "seed": 99}).json()
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    assert a["choices"][0]["token_ids"] != c["choices"][0]["token_ids"]


def test_n_choices_and_completions_with_token_prompt(inference_server) -> None:
    r = post(
        inference_server,
        "/v1/completions",
        {
            "prompt": [5, 6, 7, 8],
            "n": 4,
            "max_tokens": 5,
            "logprobs": 2,
            "return_token_ids": True,
            "ignore_eos": True,
        },
    ).json()
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    assert r["prompt_token_ids"] == [5, 6, 7, 8]
    for c in r["choices"]:
        assert len(c["token_ids"]) == 5 and len(c["logprobs"]["token_logprobs"]) == 5
        # a dict keyed by token text: two byte-fragment tokens may share the text "\ufffd"
        assert all(1 <= len(t) <= 2 for t in c["logprobs"]["top_logprobs"])
    assert len({tuple(c["token_ids"]) for c in r["choices"]}) > 1  # 4 independent samples


def test_greedy_stop_and_max_tokens(inference_server) -> None:
    body = {
        "messages": MSGS,
        "max_tokens": 20,
        "temperature": 0,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    a = post(inference_server, "/v1/chat/completions", body).json()["choices"][0]
    b = post(inference_server, "/v1/chat/completions", body).json()["choices"][0]
    assert a["token_ids"] == b["token_ids"] and a["finish_reason"] == "length"
    text = a["message"]["content"]
    stop = text[len(text) // 2 :][:2]
    if stop.strip():
        s = post(inference_server, "/v1/chat/completions", {**body, "stop": [stop]}).json()["choices"][0]
        assert (
            s["finish_reason"] == "stop" and s["stop_reason"] == stop and stop not in s["message"]["content"]
        )


def test_concurrent_requests_are_batched(inference_server) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(base_url=inference_server.base_url, timeout=60) as c:
            before = (await c.get("/stats")).json()["batch_size_hist"]
            body = {"messages": MSGS, "max_tokens": 24, "ignore_eos": True}
            rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=body) for _ in range(16)))
            assert all(r.status_code == 200 for r in rs)
            after = (await c.get("/stats")).json()["batch_size_hist"]
        new = {int(k): v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0) > 0}
        # 16 x 24 tokens one by one would be 384 decode steps of batch 1; batching needs far fewer.
        assert max(new) >= 8, new
        assert sum(new.values()) < 16 * 24 / 4, new

    asyncio.run(run())


MALFORMED: list[tuple[str, object, int]] = [
    ("/v1/chat/completions", "{not json", 400),
    ("/v1/chat/completions", "[1, 2]", 400),
    ("/v1/chat/completions", b"\xff\xfe\x00", 400),
    ("/v1/chat/completions", {}, 400),
    ("/v1/chat/completions", {"messages": "hi"}, 400),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400),
    ("/v1/chat/completions", {"model": "no-such-model", "messages": MSGS}, 404),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": -5}, 400),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": "ten"}, 400),
    ("/v1/chat/completions", {"messages": MSGS, "max_tokens": 10**9}, 400),
    ("/v1/chat/completions", {"messages": MSGS, "n": 0}, 400),
    ("/v1/chat/completions", {"messages": MSGS, "n": 10_000}, 400),
    ("/v1/chat/completions", {"messages": MSGS, "temperature": -1}, 400),
    ("/v1/chat/completions", {"messages": MSGS, "top_p": 0}, 400),
    ("/v1/chat/completions", {"messages": MSGS, "min_p": 2}, 400),
    ("/v1/chat/completions", {"messages": MSGS, "repetition_penalty": 0}, 400),
    ("/v1/chat/completions", {"messages": MSGS, "top_k": -7}, 400),
    ("/v1/chat/completions", {"messages": MSGS, "top_logprobs": 99, "logprobs": True}, 400),
    ("/v1/chat/completions", {"messages": MSGS, "stop": 5}, 400),
    ("/v1/chat/completions", {"messages": MSGS, "seed": "x"}, 400),
    ("/v1/chat/completions", {"messages": MSGS, "stream": True}, 400),
    ("/v1/chat/completions", {"messages": MSGS, "logprobs": "yes"}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"function": {}}]}]}, 400),
    ("/v1/chat/completions", {"messages": MSGS, "prompt_token_ids": [1, -3]}, 400),
    ("/v1/chat/completions", {"messages": MSGS, "prompt_token_ids": [10**7]}, 400),
    ("/v1/completions", {"prompt": [7] * 3000, "max_tokens": 1}, 400),  # longer than the context
    ("/v1/completions", {"prompt": []}, 400),
    ("/v1/completions", {"prompt": [[1], "mixed"]}, 400),
    ("/v1/completions", {"prompt": "x", "logprobs": 100}, 400),
    ("/v1/completions", {"prompt": "", "max_tokens": 1}, 400),
    ("/tokenize", {"prompt": 5}, 400),
    ("/detokenize", {"tokens": [-1]}, 400),
    ("/update_weights", {"step": 1, "path": "/definitely/not/here"}, 400),
    ("/update_weights", {"step": -1, "path": "/tmp"}, 400),
    ("/update_weights", {"step": 1}, 400),
    ("/update_weights", {"step": 1, "transport": "collective"}, 409),
    ("/update_weights", {"step": 1, "transport": "carrier-pigeon"}, 400),
    ("/init_broadcaster", {"host": "127.0.0.1", "port": 0, "world_size": 2, "rank": 1}, 400),
    ("/init_broadcaster", {"host": "127.0.0.1", "port": 1234, "world_size": 2, "rank": 5}, 400),
    (
        "/init_broadcaster",
        {"host": "127.0.0.1", "port": 1234, "world_size": 2, "rank": 1, "receivers": 0},
        400,
    ),
    ("/load_lora_adapter", {"lora_name": "a", "lora_path": "/nope"}, 400),
    ("/load_lora_adapter", {}, 400),
    ("/v1/nothing", {}, 404),
]


def test_malformed_requests_leave_the_server_healthy(inference_server, tmp_path: Path) -> None:
    (tmp_path / "bad.safetensors").write_bytes(b"garbage, not safetensors")
    cases = [*MALFORMED, ("/update_weights", {"step": 1, "path": str(tmp_path)}, 400)]

    async def run() -> int:
        sem = asyncio.Semaphore(16)
        async with httpx.AsyncClient(base_url=inference_server.base_url, timeout=60) as c:

            async def one(path: str, body: object, status: int) -> None:
                content = body if isinstance(body, str | bytes) else json.dumps(body)
                async with sem:
                    r = await c.post(path, content=content)
                assert r.status_code == status, (path, body, r.status_code, r.text)
                err = r.json()["error"]
                assert err["message"] and err["type"] and err["code"] == status

            todo = [cases[i % len(cases)] for i in range(5 * len(cases))]
            await asyncio.gather(*(one(*case) for case in todo))
            bad_method = await c.get("/v1/chat/completions")
            assert bad_method.status_code == 405 and "error" in bad_method.json()
            return len(todo)

    assert asyncio.run(run()) >= 200
    health = httpx.get(f"{inference_server.base_url}/health").json()
    assert health["status"] == "ok" and health["policy_step"] == 0
    ok = post(inference_server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"
    assert httpx.get(f"{inference_server.base_url}/stats").json()["engine_errors"] == 0


def test_openai_client_gets_chat_completions_with_logprobs(inference_server) -> None:
    openai = pytest.importorskip("openai")

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{inference_server.base_url}/v1", api_key="unused")
        resp = await client.chat.completions.create(
            model=(await client.models.list()).data[0].id,
            messages=MSGS,
            max_tokens=6,
            logprobs=True,
            top_logprobs=3,
            temperature=0.8,
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
        choice = resp.choices[0]
        assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
        assert len(choice.logprobs.content) == 6
        assert all(x.logprob <= 0 and len(x.top_logprobs) == 3 for x in choice.logprobs.content)
        assert len(choice.model_extra["token_ids"]) == 6
        assert resp.model_extra["prompt_token_ids"]
        await client.close()

    asyncio.run(run())


def test_tool_calls_are_parsed_when_tools_are_given(inference_server) -> None:
    from hpcrl.inference.protocol import extract_tool_calls

    content, calls = extract_tool_calls('ok <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    assert content == "ok" and calls[0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    msgs = [
        *MSGS,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    r = post(inference_server, "/v1/chat/completions", {"messages": msgs, "tools": tools, "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_seeded_request_is_independent_of_its_batch(inference_server) -> None:
    body = {"messages": MSGS, "max_tokens": 16, "seed": 7, "return_token_ids": True, "ignore_eos": True}

    async def run() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=inference_server.base_url, timeout=60) as c:
            alone = (await c.post("/v1/chat/completions", json=body)).json()
            others = [
                c.post("/v1/chat/completions", json={**body, "seed": None, "max_tokens": 8 + i})
                for i in range(7)
            ]
            crowd = await asyncio.gather(c.post("/v1/chat/completions", json=body), *others)
        return [alone["choices"][0]["token_ids"], crowd[0].json()["choices"][0]["token_ids"]]

    alone, crowded = asyncio.run(run())
    assert alone == crowded


def test_sampling_filters_match_hand_computation() -> None:
    from hpcrl.inference.sampling import RowParams, processed_logprobs, sample

    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    probs = torch.softmax(logits, 1)[0]  # [0.61, 0.22, 0.14, 0.03, 0.004]
    # top_p=0.8: keep tokens while the mass before them is < 0.8 -> {0, 1}
    lp, _ = processed_logprobs(logits, [RowParams(top_p=0.8)])
    kept = torch.isfinite(lp[0]) & (lp[0] > -1e30)
    assert kept.tolist() == [True, True, False, False, False]
    assert torch.allclose(lp[0, :2].exp(), probs[:2] / probs[:2].sum())
    # min_p=0.2: keep p >= 0.2 * max -> {0, 1, 2}
    lp, _ = processed_logprobs(logits, [RowParams(min_p=0.2)])
    assert (lp[0] > -1e30).tolist() == [True, True, True, False, False]
    # repetition penalty 2 on tokens {0, 3}: 2.0 -> 1.0 and -1.0 -> -2.0
    lp, _ = processed_logprobs(logits, [RowParams(repetition_penalty=2.0)], seen=[[0, 3]])
    want = torch.log_softmax(torch.tensor([1.0, 1.0, 0.5, -2.0, -3.0]), 0)
    assert torch.allclose(lp[0], want, atol=1e-6)
    # the exponential race samples the distribution: frequencies within 3 sigma over 4000 draws
    lp, greedy = processed_logprobs(logits.repeat(4000, 1), [RowParams()] * 4000)
    draws = sample(lp, greedy, [RowParams()] * 4000, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=5).float() / 4000
    assert torch.all((freq - probs).abs() < 3 * (probs * (1 - probs) / 4000).sqrt() + 1e-3)


def test_prompt_logprobs_equal_a_direct_forward_pass(inference_server, model) -> None:
    """vLLM's `prompt_logprobs` (what on-policy distillation asks of a teacher)."""
    ids = [5, 17, 42, 99, 7, 13]
    r = post(inference_server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    got = [plp[i][str(ids[i])]["logprob"] for i in range(1, len(ids))]
    want = reference_logprobs(model, ids[:1], ids[1:])
    assert max(abs(a - b) for a, b in zip(got, want)) < LOGPROB_ATOL
    bad = post(inference_server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 5})
    assert bad.status_code == 400 and "prompt_logprobs" in bad.text
