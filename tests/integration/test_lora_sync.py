"""LoRA RL syncs only the adapter: after the first (full) policy, the trainer publishes peft-format
adapters (files, or the adapter's tensors over the gloo weight group), the servers merge them
(/load_lora_adapter or /update_weights; checksum verified), weights/sync_bytes is logged every step
and stays far below the full model's bytes, and [adapters] interval keeps adapters/step_N in the run
dir."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.bus import PolicyReady
from hpcrl.bus.files import read_message
from hpcrl.monitor.metrics import read_metrics
from hpcrl.net import free_port
from hpcrl.paths import RunPaths

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["filesystem", "collective"])
def test_lora_run_syncs_only_the_adapter(tmp_path: Path, transport: str) -> None:
    out = tmp_path / "run"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpcrl.cli",
            "run",
            str(REPO / "configs/demo/lora.toml"),
            "--output-dir",
            str(out),
            "--max-steps",
            "3",
            "--ckpt.adapter-interval",
            "2",
            "--orchestrator.train.sampling.max-tokens",
            "8",
            "--trainer.broadcast.transport",
            transport,
            "--log.plots",
            "false",
        ],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    paths = RunPaths(out)
    full = read_message(paths.policy_file(0), PolicyReady)
    assert not full.adapter  # the base goes once, in full
    sync = {
        m["step"]: m["weights/sync_bytes"]
        for m in read_metrics(paths.metrics_file)
        if m.get("role") == "trainer" and "weights/sync_bytes" in m
    }
    assert sorted(sync) == [1, 2, 3]
    for step in (1, 2, 3):
        msg = read_message(paths.policy_file(step), PolicyReady)
        assert msg.adapter and msg.transport == transport and msg.num_bytes == sync[step]
        assert sync[step] < 0.10 * full.num_bytes, (sync[step], full.num_bytes)
    orch = paths.log_file("orchestrator").read_text()
    assert "policy 3 loaded on 1 server(s) (checksum verified" in orch
    assert sorted(p.name for p in paths.adapters_dir.iterdir()) == ["step_2", "step_3"]
    assert (paths.adapter_dir(2) / "adapter_model.safetensors").is_file()


def _perturb_adapter(model, seed: int) -> None:
    """What a training step does to the adapter (peft starts B at zero: the adapter would be a no-op)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


@pytest.mark.timeout(300)
def test_lora_over_gloo_broadcasts_only_the_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The trainer's publisher (collective transport, a real peft model) sends policy 0 merged, then only
    the adapter over a gloo group; the orchestrator's PolicySync has a live hf server receive and merge
    it (checksum verified) and send requests under the adapter's name; the merged result serves exactly
    what loading the same adapter from files serves; a wrong checksum is refused."""
    from hpcrl.bus import Bus
    from hpcrl.bus.messages import ADAPTER_NAME
    from hpcrl.inference.client import InferenceClient, WeightSyncError
    from hpcrl.models.load import LoraParams
    from hpcrl.models.spec import load_model
    from hpcrl.orchestrator.policy import PolicySync
    from hpcrl.trainer.model import adapter_tensors, save_adapter
    from hpcrl.trainer.publish import PolicyPublisher
    from hpcrl.weights.checksum import payload_bytes, state_dict_checksum
    from hpcrl.weights.collective import broadcast_weights, init_group
    from tests.conftest import InferenceServer

    paths = RunPaths(tmp_path / "run")
    model = load_model(tiny_model_dir, lora=LoraParams(rank=4, alpha=8, target_modules=("q_proj", "v_proj")))
    srv = InferenceServer(tiny_model_dir, paths.root)
    msgs = [{"role": "user", "content": "Sort: d c b a"}]
    greedy = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def out(c: InferenceClient, model_name: str | None = None) -> tuple:
        ch = (await c.chat_completion(msgs, model=model_name, **greedy))["choices"][0]
        return (
            ch["token_ids"],
            [round(x["logprob"], 5) for x in ch["logprobs"]["content"]],
            ch["policy_steps"],
        )

    async def run() -> None:
        port = free_port()
        pub_bus = Bus(paths, "trainer", 0, listen=False)
        sync = PolicySync(
            paths, Bus(paths, "orchestrator", listen=False), [srv.base_url], "collective", 60, 60
        )
        async with InferenceClient(srv.base_url) as c:
            group, _ = await asyncio.gather(
                asyncio.to_thread(init_group, "127.0.0.1", port, 2, 0, timeout_s=60),
                c.init_broadcaster("127.0.0.1", port, 2, 1, timeout=60),
            )
            pub = PolicyPublisher(paths, pub_bus, 0, "collective", keep=2, weight_group=group)
            outputs, full_bytes = {}, 0
            for step in (0, 1, 2):
                if step:
                    _perturb_adapter(model, seed=step)
                sent = asyncio.create_task(asyncio.to_thread(pub.publish, model, step))
                msg = await sync.exact(step)
                await sync.ensure(msg)  # /update_weights receives the broadcast
                await sent
                await sync.verify(msg)
                assert sync.adapter == (ADAPTER_NAME if step else None)
                if step == 0:
                    assert not msg.adapter and msg.transport == "collective"
                    full_bytes = msg.num_bytes
                    outputs[0] = await out(c)
                    continue
                adapter = adapter_tensors(model)
                assert msg.adapter and msg.transport == "collective" and msg.path is None
                assert msg.checksum == state_dict_checksum(adapter)
                assert pub.last_sync_bytes == msg.sync_bytes == payload_bytes(adapter) < 0.10 * full_bytes
                info = await c.weights()
                assert info["lora_checksum"] == msg.checksum and info["step"] == step
                assert info["lora_adapters"] == {ADAPTER_NAME: f"broadcast:step_{step}"}
                outputs[step] = await out(c, sync.adapter)
                assert outputs[step][2] == [step] and outputs[step][:2] != outputs[0][:2]
                # The same adapter from files (the filesystem transport's route) serves the same bits:
                # the broadcast merge replaced the previous adapter rather than adding to it.
                ref = save_adapter(model, paths.root / f"ref_{step}")
                r = await c.load_lora_adapter(ADAPTER_NAME, str(ref), step=step)
                assert r["checksum"] == msg.checksum
                assert await out(c, ADAPTER_NAME) == outputs[step]
            # A corrupt broadcast (the checksum does not match the adapter) is refused.
            bad = adapter_tensors(model)
            cfg = {"r": 4, "lora_alpha": 8}
            sent = asyncio.to_thread(
                broadcast_weights, group, bad, 3, checksum="xxh3_128:" + "0" * 32, adapter=cfg
            )
            with pytest.raises(WeightSyncError, match="checksum"):
                await asyncio.gather(sent, c.update_weights(3, collective=True))
        await sync.aclose()

    try:
        asyncio.run(run())
    finally:
        srv.stop()
