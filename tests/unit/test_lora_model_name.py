"""LoRA RL names the adapter in requests once every server holds it (vLLM applies an adapter only to
requests whose `model` is its name), and the base again after full weights; the vLLM route's pure
parts: hpcrl's `step` kept out of vLLM's request, and which policy a request was served by."""

from __future__ import annotations

import asyncio

import pytest

from hpcrl.bus import Bus, PolicyReady
from hpcrl.bus.messages import ADAPTER_NAME
from hpcrl.inference import vllm_routes as vr
from hpcrl.orchestrator.policy import PolicySync
from hpcrl.orchestrator.rollout import ServerPool
from hpcrl.paths import RunPaths


def _policy(step: int, adapter: bool) -> PolicyReady:
    return PolicyReady(
        step=step,
        transport="filesystem",
        path=f"/run/broadcasts/step_{step}",
        checksum="c",
        adapter=adapter,
        num_params=1,
        num_bytes=4,
    )


def test_requests_name_the_adapter_only_while_it_is_the_policy(tmp_path) -> None:
    paths = RunPaths(tmp_path)
    sync = PolicySync(paths, Bus(paths, "orchestrator", listen=False), [], "filesystem", 5, 5)
    pool = ServerPool(["http://127.0.0.1:9"], model="Qwen/Qwen3-0.6B", timeout=5, max_concurrent=1)
    pool.adapter = lambda: sync.adapter  # what Setup.attach_servers wires for the student servers

    async def go() -> list[str]:
        seen = [pool.request_model]
        for step, adapter in ((0, False), (1, True), (2, True), (3, False)):
            await sync._load(_policy(step, adapter))  # no servers: only the bookkeeping runs
            seen.append(pool.request_model)
        await pool.aclose()
        return seen

    assert asyncio.run(go()) == [
        "Qwen/Qwen3-0.6B",
        "Qwen/Qwen3-0.6B",
        ADAPTER_NAME,
        ADAPTER_NAME,
        "Qwen/Qwen3-0.6B",
    ]


def test_vllm_lora_body_keeps_hpcrl_fields_out_of_vllms_request() -> None:
    body = {"lora_name": ADAPTER_NAME, "lora_path": "/run/broadcasts/step_4", "step": 4}
    assert vr.lora_request_body(body) == {
        "lora_name": ADAPTER_NAME,
        "lora_path": "/run/broadcasts/step_4",
        "load_inplace": True,
    }
    assert vr.lora_step(body) == 4 and vr.lora_step({}) is None
    for bad in ("4", -1, True, 4.0):
        with pytest.raises(ValueError, match="step"):
            vr.lora_step({"step": bad})


def test_vllm_tags_requests_with_the_policy_that_served_them() -> None:
    status = vr.initial_status()
    assert vr.policy_step_for(status, "base") == 0
    status.update(step=5, base_step=5)  # full weights of policy 5
    assert vr.policy_step_for(status, "base") == vr.policy_step_for(status, ADAPTER_NAME) == 5
    status.update(step=6, lora_adapters={ADAPTER_NAME: "/p"})  # adapter of policy 6 on base 5
    assert vr.policy_step_for(status, ADAPTER_NAME) == 6
    assert vr.policy_step_for(status, "base") == 5  # vLLM ran this request without the adapter
