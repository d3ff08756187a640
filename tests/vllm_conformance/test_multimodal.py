"""Vision-language RL against vLLM 0.33's own modules: the chat request hpcrl's orchestrator sends for a
prompt with images (OpenAI image_url parts, return_token_ids, logprobs) is one vLLM's chat endpoint
validates as is, and every weight name hpcrl's trainer publishes for a Qwen3-VL model (transformers'
names: model.visual.*, model.language_model.*, lm_head.*) maps through vLLM's own Qwen3-VL
hf_to_vllm_mapper onto its modules. vLLM's qwen3_vl module imports torchvision, which the CPU venv
lacks, so its mapper is read from the module's source (the literal vLLM builds its WeightsMapper from)."""

from __future__ import annotations

import ast
import asyncio
import inspect
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_conformance._vllm import require_vllm

vllm = require_vllm()

from hpcrl.envs.builtin.color_codeword import png_data_url  # noqa: E402
from hpcrl.inference.client import InferenceClient  # noqa: E402


def _sent_body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The body hpcrl's client posts to /v1/chat/completions (what RolloutClient asks for)."""
    client = InferenceClient.__new__(InferenceClient)
    seen: dict[str, Any] = {}

    async def capture(method: str, path: str, body: dict[str, Any], *a: Any, **k: Any) -> dict[str, Any]:
        seen.update(body)
        return {}

    client._request = capture  # type: ignore[method-assign]
    asyncio.run(client.chat_completion(messages, model="policy", n=2, max_tokens=8, seed=3))
    return seen


def test_vllm_validates_the_image_chat_request_as_hpcrl_sends_it() -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    url = png_data_url((200, 10, 10), 32)
    messages = [
        {"role": "system", "content": "codewords"},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}],
        },
    ]
    req = ChatCompletionRequest.model_validate(_sent_body(messages))
    assert req.return_token_ids and req.logprobs and req.n == 2
    part = req.messages[1]["content"][0]
    assert part["type"] == "image_url" and part["image_url"]["url"] == url


def _qwen3_vl_prefixes() -> dict[str, str]:
    import importlib.util

    spec = importlib.util.find_spec("vllm.model_executor.models.qwen3_vl")
    assert spec is not None and spec.origin is not None
    tree = ast.parse(Path(spec.origin).read_text())
    cls = next(
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen3VLForConditionalGeneration"
    )
    for node in cls.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", "") == "hf_to_vllm_mapper" for t in node.targets
        ):
            call = node.value
            assert isinstance(call, ast.Call)
            kw = next(k for k in call.keywords if k.arg == "orig_to_new_prefix")
            return ast.literal_eval(kw.value)
    raise AssertionError("no hf_to_vllm_mapper on vLLM's Qwen3VLForConditionalGeneration")


def test_published_qwen3_vl_names_map_through_vllms_own_mapper(tmp_path: Path) -> None:
    from vllm.model_executor.models.utils import WeightsMapper

    from hpcrl.models.tiny_vlm import build_tiny_vlm

    assert "orig_to_new_prefix" in inspect.signature(WeightsMapper).parameters
    mapper = WeightsMapper(orig_to_new_prefix=_qwen3_vl_prefixes())
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(build_tiny_vlm(tmp_path / "m"), dtype=torch.float32)
    names = list(model.state_dict())  # what the trainer publishes (transformers' own names)
    mapped = {n: mapper._map_name(n) for n in names}
    roots = ("visual.", "language_model.model.", "language_model.lm_head.")
    bad = [n for n, m in mapped.items() if m is None or not m.startswith(roots)]
    assert not bad, bad[:5]
    assert any(m.startswith("visual.") for m in mapped.values())


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("model.visual.merger.linear_fc1.weight", "visual.merger.linear_fc1.weight"),
        (
            "model.language_model.layers.0.mlp.up_proj.weight",
            "language_model.model.layers.0.mlp.up_proj.weight",
        ),
        ("lm_head.weight", "language_model.lm_head.weight"),
    ],
)
def test_mapper_examples(name: str, want: str) -> None:
    from vllm.model_executor.models.utils import WeightsMapper

    assert WeightsMapper(orig_to_new_prefix=_qwen3_vl_prefixes())._map_name(name) == want
