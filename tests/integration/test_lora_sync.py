"""LoRA RL syncs only the adapter: after the first (full) policy, the trainer publishes peft-format
adapters, the servers merge them through /load_lora_adapter (checksum verified), weights/sync_bytes
is logged every step and stays far below the full model's bytes, and [adapters] interval keeps
adapters/step_N in the run dir."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.bus import PolicyReady
from hpcrl.bus.files import read_message
from hpcrl.monitor.metrics import read_metrics
from hpcrl.paths import RunPaths

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lora_run_syncs_only_the_adapter(tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "hpcrl.cli", "run", str(REPO / "configs/demo/lora.toml"),
                        "--output-dir", str(out), "--max-steps", "3", "--ckpt.adapter-interval", "2",
                        "--orchestrator.train.sampling.max-tokens", "8"],
                       capture_output=True, text=True, timeout=540)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    paths = RunPaths(out)
    full = read_message(paths.policy_file(0), PolicyReady)
    assert not full.adapter  # the base goes once, in full
    sync = {m["step"]: m["weights/sync_bytes"] for m in read_metrics(paths.metrics_file)
            if m.get("role") == "trainer" and "weights/sync_bytes" in m}
    assert sorted(sync) == [1, 2, 3]
    for step in (1, 2, 3):
        msg = read_message(paths.policy_file(step), PolicyReady)
        assert msg.adapter and msg.num_bytes == sync[step]
        assert sync[step] < 0.10 * full.num_bytes, (sync[step], full.num_bytes)
    orch = paths.log_file("orchestrator").read_text()
    assert "policy 3 loaded on 1 server(s) (checksum verified" in orch
    assert sorted(p.name for p in paths.adapters_dir.iterdir()) == ["step_2", "step_3"]
    assert (paths.adapter_dir(2) / "adapter_model.safetensors").is_file()
