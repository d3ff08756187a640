"""LoRA RL after a resume: the new trainer process publishes its first policy in full (W + s B_k A_k,
merged); a server that then merged adapter k+1 on top of it would serve W + s B_k A_k + s B_k+1 A_k+1.
The policies after a resume must serve exactly the trainer's merged model (hpcrl.trainer.model.adapter_sync)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from hpcrl.paths import RunPaths
from tests.integration.test_lora_sync import _perturb_adapter


@pytest.mark.timeout(300)
def test_policies_after_a_lora_resume_serve_the_trainers_merged_model(tiny_model_dir: Path, tmp_path: Path):
    from hpcrl.bus import Bus
    from hpcrl.inference.client import InferenceClient
    from hpcrl.models.load import LoraParams
    from hpcrl.models.spec import load_model
    from hpcrl.orchestrator.policy import PolicySync
    from hpcrl.trainer.model import hf_named_tensors, write_weight_files
    from hpcrl.trainer.publish import PolicyPublisher
    from tests.conftest import InferenceServer

    model = load_model(tiny_model_dir, lora=LoraParams(rank=4, alpha=8, target_modules=("q_proj", "v_proj")))
    srv = InferenceServer(tiny_model_dir, tmp_path / "srv")
    ref_srv = InferenceServer(tiny_model_dir, tmp_path / "ref_srv")  # serves the merged model, in full
    msgs = [{"role": "user", "content": "Sort: d c b a"}]
    greedy = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def out(c: InferenceClient, name: str | None) -> tuple[list[int], list[float]]:
        ch = (await c.chat_completion(msgs, model=name, **greedy))["choices"][0]
        return ch["token_ids"], [x["logprob"] for x in ch["logprobs"]["content"]]

    async def run() -> None:
        async with InferenceClient(srv.base_url) as c, InferenceClient(ref_srv.base_url) as rc:
            for run_no, steps in ((0, (0, 1)), (1, (1, 2, 3))):  # run 1: the trainer resumed at step 1
                paths = RunPaths(tmp_path / f"run{run_no}")
                pub = PolicyPublisher(paths, Bus(paths, "trainer", 0, listen=False), 0, "filesystem", keep=4)
                sync = PolicySync(
                    paths, Bus(paths, "orchestrator", listen=False), [srv.base_url], "filesystem", 60, 60
                )
                for step in steps:
                    if step != steps[0]:
                        _perturb_adapter(model, seed=step)  # a training step
                    pub.publish(model, step)
                    msg = await sync.exact(step)
                    await sync.ensure(msg)
                    await sync.verify(msg)
                    served = await out(c, sync.adapter)
                    ref = tmp_path / f"ref_{run_no}_{step}"  # the trainer's merged model, in full
                    ref.mkdir()
                    write_weight_files(ref, hf_named_tensors(model))
                    await rc.update_weights(10 * run_no + step + 1, path=str(ref))
                    want = await out(rc, None)
                    assert served[0] == want[0], (run_no, step, served, want)
                    assert served[1] == pytest.approx(want[1], abs=1e-4), (run_no, step)
                await sync.aclose()

    try:
        asyncio.run(run())
    finally:
        srv.stop()
        ref_srv.stop()
