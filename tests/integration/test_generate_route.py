"""POST /inference/v1/generate on `hpcrl inference` (embedded engine), over real HTTP: vLLM's shape,
auth, the official openai client's raw post, the renderers package's own `generate`, and bad input."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.integration.server_proc import start_inference

pytestmark = pytest.mark.slow
KEY = "generate-route-test-key"
MAX_LEN = 96
ROUTE = "/inference/v1/generate"


class CliServer:
    """`hpcrl inference` (the CLI, as a user starts it) on 127.0.0.1, a free port, a key."""

    def __init__(self, model_dir: Path, run_dir: Path):
        self.proc, self.log, self.base_url = start_inference(model_dir, run_dir, KEY, MAX_LEN)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = CliServer(tiny_model_dir, tmp_path_factory.mktemp("generate_run"))
    yield srv
    srv.stop()


def post(server, body: object, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.base_url}{ROUTE}", json=body, headers=headers, timeout=60)


SEEDED = {"token_ids": [5, 17, 42, 7], "sampling_params": {"max_tokens": 6, "seed": 3, "logprobs": 1}}


def test_shape_is_vllms(server) -> None:
    r = post(server, SEEDED)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["prompt_token_ids"] == [5, 17, 42, 7]
    (choice,) = body["choices"]
    assert len(choice["token_ids"]) <= 6 and choice["finish_reason"] in ("stop", "length")
    assert choice["routed_experts"] is None  # dense model: vLLM too sends null
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(c["logprob"] <= 0 and 1 <= len(c["top_logprobs"]) <= 2 for c in content)
    assert all(c["top_logprobs"][0]["token_id"] == t for c, t in zip(content, choice["token_ids"]))
    assert body["usage"]["prompt_tokens"] == 4
    # The same prompt ids through /v1/completions with the same seed sample the same tokens.
    ref = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"prompt": [5, 17, 42, 7], "max_tokens": 6, "seed": 3, "logprobs": 0, "return_token_ids": True},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ).json()["choices"][0]
    assert ref["token_ids"] == choice["token_ids"]
    assert ref["logprobs"]["token_logprobs"] == pytest.approx([c["logprob"] for c in content], abs=1e-5)


def test_auth_like_every_route(server) -> None:
    assert post(server, SEEDED, key=None).status_code == 401
    assert post(server, SEEDED, key="wrong").status_code == 401


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"token_ids": []}, "token_ids"),
        ({"token_ids": [1, 10**6]}, "token_ids"),
        ({"token_ids": [1, -1]}, "token_ids"),
        ({"token_ids": "hello"}, "token_ids"),
        ({"token_ids": [3] * MAX_LEN}, "token_ids"),
        ({"token_ids": [1, 2], "sampling_params": "fast"}, "sampling_params"),
        ({"token_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ({"token_ids": [1, 2], "sampling_params": {"max_tokens": 1.5}}, "sampling_params.max_tokens"),
        ({"token_ids": [1, 2], "sampling_params": {"logprobs": True}}, "sampling_params.logprobs"),
        (
            {"token_ids": [1, 2], "sampling_params": {"stop_token_ids": [10**6]}},
            "sampling_params.stop_token_ids",
        ),
        ({"token_ids": [1, 2], "sampling_params": {"min_tokens": 3}}, "sampling_params.min_tokens"),
        ({"token_ids": [1, 2], "sampling_params": {"best_of": 3}}, "sampling_params.best_of"),
        ({"token_ids": [1, 2], "stream": True}, "stream"),
        ({"token_ids": [1, 2], "model": "nope"}, "model"),
        (
            {"token_ids": [1, 2], "sampling_params": {"routed_experts_prompt_start": 2}},
            "sampling_params.routed_experts_prompt_start",
        ),
        (
            {"token_ids": [1, 2], "sampling_params": {"routed_experts_prompt_start": -1}},
            "sampling_params.routed_experts_prompt_start",
        ),
        (
            {"token_ids": [1, 2], "sampling_params": {"routed_experts_prompt_start": True}},
            "sampling_params.routed_experts_prompt_start",
        ),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field_and_changes_nothing(server, body, param) -> None:
    before = post(server, SEEDED).json()
    r = post(server, body)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == param, r.text
    after = post(server, SEEDED).json()
    assert after["choices"] == before["choices"]


def test_max_tokens_past_the_context_stops_at_its_end(server) -> None:
    r = post(
        server, {"token_ids": [4] * (MAX_LEN - 3), "sampling_params": {"max_tokens": 50, "ignore_eos": True}}
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["token_ids"]) == 3 and choice["finish_reason"] == "length"


def test_official_openai_client_raw_post(server) -> None:
    openai = pytest.importorskip("openai")

    async def run() -> dict:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=KEY)
        try:
            return await client.post(f"{server.base_url}{ROUTE}", body=SEEDED, cast_to=object)
        finally:
            await client.close()

    resp = asyncio.run(run())
    assert resp["choices"][0]["token_ids"] == post(server, SEEDED).json()["choices"][0]["token_ids"]


def test_renderers_client_generate(server, tiny_model_dir: Path) -> None:
    pytest.importorskip("renderers")
    import openai
    from renderers import DefaultRendererConfig, create_renderer
    from renderers.client import generate
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    renderer = create_renderer(tok, DefaultRendererConfig())
    messages = [{"role": "user", "content": "Reverse: abc"}]

    async def run() -> dict:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=KEY)
        try:
            return await generate(
                client=client,
                renderer=renderer,
                messages=messages,
                model=(await client.models.list()).data[0].id,
                sampling_params={"max_tokens": 8, "temperature": 1.0, "seed": 11},
            )
        finally:
            await client.close()

    out = asyncio.run(run())
    assert out["prompt_ids"] == renderer.render_ids(messages, add_generation_prompt=True)
    assert 1 <= len(out["completion_ids"]) <= 8
    assert len(out["completion_logprobs"]) == len(out["completion_ids"])
    assert out["routed_experts"] is None
    # What the client parsed is what the server sampled: ask again with the same seed.
    raw = post(
        server,
        {
            "token_ids": out["prompt_ids"],
            "sampling_params": {
                "max_tokens": 8,
                "seed": 11,
                "logprobs": 1,
                "stop_token_ids": renderer.get_stop_token_ids(),
                "skip_special_tokens": False,
            },
        },
    ).json()["choices"][0]
    assert raw["token_ids"] == out["completion_ids"]


def test_moe_choices_carry_routing_in_the_shape_verifiers_reads(tmp_path_factory) -> None:
    """A tiny Qwen3-MoE: every choice's `routed_experts` is the dict renderers / verifiers 0.4 decode,
    one row per position from `routed_experts_prompt_start` (the prefill's rows, then one per
    completion token; experts in range; -1 only on the last token, never fed back)."""
    import base64

    import numpy as np

    from hpcrl.inference.routed import completion_rows
    from hpcrl.models.resolve import resolve_model

    srv = CliServer(Path(resolve_model("hpcrl/tiny-qwen3-moe")), tmp_path_factory.mktemp("generate_moe"))
    try:
        prompt = [5, 17, 42, 7, 9]
        sp = {"max_tokens": 6, "seed": 1, "ignore_eos": True, "n": 2}
        whole = post(srv, {"token_ids": prompt, "sampling_params": sp}).json()["choices"]
        r = post(srv, {"token_ids": prompt, "sampling_params": {**sp, "routed_experts_prompt_start": 3}})
        assert r.status_code == 200, r.text
        for choice, full in zip(r.json()["choices"], whole):
            payload, n = choice["routed_experts"], len(choice["token_ids"])
            assert payload["start"] == 3 and payload["shape"] == [2 + n, 2, 2], payload
            arr = np.frombuffer(base64.b64decode(payload["data"]), np.int16).reshape(payload["shape"])
            assert ((arr[:-1] >= 0) & (arr[:-1] < 8)).all() and (arr[-1] == -1).all()
            assert completion_rows(payload, len(prompt), n) == arr[2:].tolist()
            f = full["routed_experts"]
            assert f["start"] == 0 and f["shape"][0] == len(prompt) + n
            ref = np.frombuffer(base64.b64decode(f["data"]), np.int16).reshape(f["shape"])
            assert (ref[3:] == arr).all()  # same prompt, same seed: the same routing from position 3
    finally:
        srv.stop()
