"""`hpcrl run`'s host-memory plan (hpcrl.launch.host_memory.local_check): every process it starts on
this one machine against this machine's memory (MemTotal or the cgroup limit). Numbers checked by
hand."""

from __future__ import annotations

import pytest

from hpcrl.errors import ConfigError
from hpcrl.launch import host_memory as hm
from hpcrl.launch.checks import load
from hpcrl.launch.placement import local_placement
from hpcrl.models.arch import KNOWN, from_config

GIB = 1024**3
P30 = from_config(KNOWN["Qwen/Qwen3-30B-A3B"], "test").params  # 56.87 GiB in bf16


def test_machine_memory_is_memtotal_or_the_lower_cgroup_limit(tmp_path):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       24684092 kB\nMemFree:        17426088 kB\n")
    cg = tmp_path / "cg"
    cg.mkdir()
    assert hm.machine_memory_mb(str(info), str(cg)) == 24105  # 24684092 // 1024
    (cg / "memory.max").write_text("max\n")  # no limit
    assert hm.machine_memory_mb(str(info), str(cg)) == 24105
    (cg / "memory.max").write_text("8589934592\n")  # an 8 GiB cgroup
    assert hm.machine_memory_mb(str(info), str(cg)) == 8192
    assert hm.machine_memory_mb(str(tmp_path / "none"), str(tmp_path / "none")) is None


def test_the_cpu_demo_fits_and_a_2gb_machine_would_not_hold_it():
    """configs/demo/rl.toml on CPU: 1 trainer rank + 1 hf server + the orchestrator = 3 processes x
    1 GiB; the tiny model's syncs and training state are a few MiB. On CPU `hpcrl run` prints the plan
    (information, as every memory plan on CPU); the check itself refuses 2 GiB in one line."""
    cfg = load(["configs/demo/rl.toml"]).config
    pl = local_placement(cfg, gpus_available=0)
    plan = hm.local_plan(cfg, pl)
    assert plan.processes == 3
    base = next(t for t in plan.terms if t.what == "process baselines")
    assert base.gib == 3 * hm.CPU_PROCESS_BASE_GIB == 3.0
    assert 3.0 < plan.total_gib < 3.2
    lines = hm.local_check(cfg, pl, limit_mb=8 * 1024)
    assert lines[0].startswith("  host memory (this machine): 3.1 GiB of 8.0 GiB (3 processes")
    assert "information, not checked" in hm.local_check(cfg, pl, limit_mb=2 * 1024)[-1]
    with pytest.raises(ConfigError) as e:
        plan.check(2 * 1024)
    msg = str(e.value)
    assert e.value.path == "deployment.num_trainer_ranks" and "\n" not in msg
    assert "needs 3.1 GiB" in msg and "has 2.0 GiB" in msg and "biggest: process baselines 3.0 GiB" in msg


def test_one_gpu_machine_with_delta_is_refused_naming_delta():
    """Qwen3-30B-A3B on one 8-GPU machine: 4 trainer GPUs, 4 inference GPUs (tp 4), files + delta.
    vLLM cannot take a delta (refused at load); with the hf engine (one process, applying deltas in
    place: no base) the trainer holds 4 ranks x (one 256 MiB bucket + its pieces to diff 14.22 + the
    delta base (previous shard) 14.22) = 114.7 GiB, the server one piece (a bucket, 0.25 GiB), the
    baselines 5 x 4 + 1 (orchestrator) = 21 GiB: 136.0 GiB, refused on 128 GiB."""
    args = ["--model.name", "Qwen/Qwen3-30B-A3B", "--orchestrator.train.env", '[{id = "reverse-text"}]',
            "--deployment.num-train-gpus", "4", "--deployment.num-infer-gpus", "4",
            "--inference.parallel.tp", "4", "--trainer.broadcast.transport", "filesystem"]  # fmt: skip
    policy, shard = P30 * 2 / GIB, P30 * 2 / 4 / GIB
    assert round(policy, 2) == 56.87 and round(shard, 2) == 14.22
    with pytest.raises(ConfigError) as e:
        load([*args, "--inference.backend", "vllm", "--trainer.broadcast.delta"])
    assert e.value.path == "trainer.broadcast.delta"
    delta = load([*args, "--inference.backend", "hf", "--trainer.broadcast.delta"]).config
    pl = local_placement(delta, gpus_available=8)
    plan = hm.local_plan(delta, pl)
    got = {t.what: t.gib for t in plan.terms}
    assert got["trainer syncs"] == pytest.approx(4 * (0.25 + 2 * shard))
    assert got["inference loads"] == 0.25
    assert got["process baselines"] == 5 * 4 + 1
    assert plan.total_gib == pytest.approx(136.0, abs=0.05)
    with pytest.raises(ConfigError) as e:
        hm.local_check(delta, pl, limit_mb=128 * 1024)
    assert e.value.path == "trainer.broadcast.delta" and "needs 136.0 GiB" in str(e.value)
    # vLLM without delta: one bucket per rank; each worker assembles one tensor at a time (embedding
    # 151936 x 2048 x 2 B = 0.58 GiB); 8 processes x 4 + 1 = 33 GiB
    plain = load([*args, "--inference.backend", "vllm"]).config
    plan = hm.local_plan(plain, local_placement(plain, gpus_available=8))
    embed = 151936 * 2048 * 2 / GIB
    assert plan.total_gib == pytest.approx(4 * 0.25 + 4 * embed + 33)  # 36.3 GiB
    assert plan.total_gib == pytest.approx(36.3, abs=0.05)
    hm.local_check(plain, local_placement(plain, gpus_available=8), limit_mb=128 * 1024)


def test_a_gpu_config_rehearsed_without_gpus_is_information_only():
    """configs/alphabet_sort/rl.toml asks for 2 + 2 GPUs; on a machine without GPUs `hpcrl run` places it
    on CPU (a note says so), where Qwen3-4B's fp32 training state alone is ~110 GiB: printed, not refused."""
    cfg = load(["configs/alphabet_sort/rl.toml"]).config
    lines = hm.local_check(cfg, local_placement(cfg, gpus_available=0), limit_mb=16 * 1024)
    assert "not checked" in lines[-1]
