"""vLLM 0.33 serves POST /inference/v1/generate with the request/response shape hpcrl's embedded engine
answers (hpcrl/inference/generate.py), and hpcrl's vLLM argv turns the route on."""

from __future__ import annotations

import argparse

import pytest

from tests.vllm_conformance._vllm import require_vllm

vllm = require_vllm()

from fastapi import FastAPI  # noqa: E402
from fastapi.routing import APIRoute  # noqa: E402

from hpcrl.inference import generate as ours  # noqa: E402
from hpcrl.inference.protocol import SeqOutput  # noqa: E402

PROTOCOL = "vllm.entrypoints.scale_out.token_in_token_out.protocol"
# What the renderers client (0.1.12) sends.
RENDERERS_BODY = {
    "model": "policy",
    "token_ids": [1, 2, 3],
    "sampling_params": {
        "max_tokens": 8,
        "temperature": 1.0,
        "stop_token_ids": [2],
        "logprobs": 1,
        "skip_special_tokens": False,
    },
}


def _app(enable_scale_out: bool) -> FastAPI:
    from vllm.entrypoints.scale_out.factories import register_scale_out_api_routers

    app = FastAPI()
    app.state.args = argparse.Namespace(enable_scale_out=enable_scale_out, tokens_only=False)
    register_scale_out_api_routers(app, ("generate",))
    return app


def _generate_routes(app: FastAPI) -> list[APIRoute]:
    return [r for r in app.routes if isinstance(r, APIRoute) and r.path == ours.ROUTE]


def test_the_route_is_vllms_generate_handler_when_scale_out_is_on():
    from vllm.entrypoints.scale_out.token_in_token_out import api_router

    (route,) = _generate_routes(_app(enable_scale_out=True))
    assert route.methods == {"POST"}
    assert route.endpoint.__module__ == api_router.__name__ and route.endpoint.__name__ == "generate"


def test_without_scale_out_vllm_only_answers_403():
    (route,) = _generate_routes(_app(enable_scale_out=False))
    assert route.endpoint.__name__ == "disabled_scale_out"


def test_renderers_request_is_a_valid_vllm_generate_request():
    import importlib

    req = importlib.import_module(PROTOCOL).GenerateRequest.model_validate(RENDERERS_BODY)
    assert req.token_ids == [1, 2, 3]
    assert req.sampling_params.logprobs == 1 and req.sampling_params.stop_token_ids == [2]


@pytest.mark.parametrize("token_ids", [[], [1, -1]])
def test_vllm_refuses_what_hpcrl_refuses(token_ids):
    import importlib

    import pydantic

    with pytest.raises(pydantic.ValidationError):
        importlib.import_module(PROTOCOL).GenerateRequest.model_validate(
            {**RENDERERS_BODY, "token_ids": token_ids}
        )


def test_every_sampling_field_hpcrl_reads_is_a_vllm_field():
    from vllm.sampling_params import SamplingParams

    fields = set(SamplingParams.__struct_fields__)
    assert set(ours.SUPPORTED) <= fields, set(ours.SUPPORTED) - fields
    assert set(ours.NEUTRAL) <= fields, set(ours.NEUTRAL) - fields


def test_every_request_field_hpcrl_accepts_is_a_vllm_field():
    import importlib

    fields = set(importlib.import_module(PROTOCOL).GenerateRequest.model_fields)
    assert {"model", "token_ids", "sampling_params", *ours.NEUTRAL_TOP} <= fields


def test_hpcrl_response_is_a_valid_vllm_tokens_response():
    import importlib

    proto = importlib.import_module(PROTOCOL)
    params = ours.parse_sampling_params(RENDERERS_BODY["sampling_params"], vocab_size=10)
    out = SeqOutput([4, 2], [-0.5, -0.1], [[(5, -0.2)], [(2, -0.1)]], "", "stop", 2, [0])
    body = ours.response("policy", [1, 2, 3], [out], params)
    resp = proto.GenerateTokensResponse.model_validate(body)
    choice = resp.choices[0]
    assert choice.token_ids == [4, 2] and choice.finish_reason == "stop" and choice.routed_experts is None
    assert [c.token_id for c in choice.logprobs.content] == [4, 2]
    assert [t.token_id for t in choice.logprobs.content[0].top_logprobs] == [4, 5]  # sampled first
    assert resp.prompt_token_ids == [1, 2, 3]
    # Every field vLLM's choice has is in ours (hpcrl adds policy_steps), so a client reads the same keys.
    vllm_choice_fields = set(proto.GenerateTokensChoice.model_fields) - {"sampling_mask", "weight_versions"}
    assert vllm_choice_fields <= set(body["choices"][0])
