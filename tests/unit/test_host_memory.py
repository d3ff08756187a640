"""The dry-run host-memory plan (hpcrl.launch.host_memory): numbers checked by hand for seed 000's
layout, Qwen3-30B-A3B on 2 trainer + 2 inference nodes x 8 GPUs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from hpcrl.errors import ConfigError
from hpcrl.launch import host_memory as hm
from hpcrl.launch.checks import load
from hpcrl.launch.partition import NodeOffer
from hpcrl.launch.placement import slurm_placement
from hpcrl.models.arch import KNOWN, from_config

GIB, MIB = 1024**3, 1024**2
Q30B = from_config(KNOWN["Qwen/Qwen3-30B-A3B"], "test")
P = Q30B.params  # 30.53 B: 61.1 GB = 56.9 GiB in bf16
SHARD = P * 2 / 16 / GIB  # 3.55 GiB per rank of 16


def seed(*args):
    base = ["--model.name", "Qwen/Qwen3-30B-A3B", "--orchestrator.train.env", '[{id = "reverse-text"}]',
            "--slurm.time", "01:00:00", "--deployment.num-train-nodes", "2", "--deployment.num-infer-nodes",
            "2", "--slurm.gpus-per-node", "8", "--inference.parallel.tp", "8"]  # fmt: skip
    cfg = load([*base, *args]).config
    return cfg, slurm_placement(cfg)


def node(mem_gib: int) -> list[NodeOffer]:
    return [NodeOffer(f"n{i}", 64, mem_gib * 1024, 8) for i in range(4)]


def test_per_rank_figures_by_hand():
    assert round(P * 2 / GIB, 2) == 56.87
    assert round(SHARD, 3) == 3.554
    fs = dict(collective=False, bucket_mb=256)
    # sharded filesystem: shard + 2 buckets of 256 MiB = 3.55 + 0.5
    assert hm.trainer_rank_gib(P, 16, 2, **fs) == pytest.approx(SHARD + 0.5)
    # delta per shard adds the previous shard
    assert hm.trainer_rank_gib(P, 16, 2, delta=True, **fs) == pytest.approx(2 * SHARD + 0.5)
    # collective: every rank (rank 0 too) sends its own pieces: shard + 2 chunks of chunk_mb
    assert hm.trainer_rank_gib(P, 16, 2, collective=True, rank0=True) == pytest.approx(SHARD + 0.5)
    assert hm.trainer_rank_gib(P, 16, 2, collective=True, chunk_mb=64) == pytest.approx(SHARD + 0.125)
    # the gathered path: the whole policy on every rank, and the previous one on rank 0 with delta
    assert hm.trainer_rank_gib(P, 16, 2, sharded=False) == pytest.approx(56.87, abs=0.01)
    assert hm.trainer_rank_gib(P, 16, 2, sharded=False, delta=True, rank0=True) == pytest.approx(
        2 * 56.87, abs=0.02
    )
    # a checkpoint's HF export: rank 0 holds one 1 GiB file + the largest tensor; the publish is larger here
    big = hm.trainer_rank_gib(P, 1024, 2, rank0=True, largest_tensor=151936 * 2048)
    assert big == pytest.approx(1 + 151936 * 2048 * 2 / GIB)  # 1.58 GiB > 56.9 / 1024 + 0.5
    # inference: vLLM over files keeps the whole policy per tp worker; over the collective one bucket each
    assert hm.server_gib(P, 2, tp=8, vllm=True, collective=False, chunk_mb=256) == pytest.approx(
        8 * 56.87, abs=0.1
    )
    assert hm.server_gib(P, 2, tp=8, vllm=True, collective=True, chunk_mb=256) == 2.0
    assert hm.server_gib(P, 2, tp=8, vllm=False, collective=False, chunk_mb=256) == pytest.approx(
        56.87, abs=0.01
    )


def test_seed_layout_sharded_fits_a_1tb_node():
    cfg, pl = seed()
    lines = hm.dry_run_lines(cfg, pl, node(1024))
    plan = hm.host_plan(cfg, pl)
    # collective (auto): every rank 3.55 + 2 x 0.25, 8 x 4 GiB baseline
    assert plan.trainer.held_gib == pytest.approx(8 * (SHARD + 0.5))
    assert plan.trainer.total_gib == pytest.approx(64.4, abs=0.05)
    assert plan.inference.total_gib == pytest.approx(8 * 0.25 + 8 * hm.PROCESS_BASE_GIB)
    assert any("trainer node: 64.4 GiB of 1024 GiB" in x for x in lines)
    assert any("inference node: 34.0 GiB of 1024 GiB" in x for x in lines)


def test_gather_every_rank_is_refused_on_a_256gb_node():
    cfg, pl = seed("--no-trainer.broadcast.sharded")
    assert hm.host_plan(cfg, pl).trainer.total_gib == pytest.approx(8 * 56.87 + 32, abs=0.1)  # 487 GiB
    with pytest.raises(ConfigError) as e:
        hm.dry_run_lines(cfg, pl, node(256))
    assert e.value.path == "trainer.broadcast.sharded" and "\n" not in str(e.value)
    assert "487 GiB" in str(e.value) and "has 256 GiB" in str(e.value)
    hm.dry_run_lines(cfg, pl, node(1024))  # 487 GiB in 1 TB: fits


def test_delta_adds_the_previous_shard():
    plain, pl = seed("--trainer.broadcast.transport", "filesystem")
    delta, _ = seed("--trainer.broadcast.transport", "filesystem", "--trainer.broadcast.delta")
    gap = hm.host_plan(delta, pl).trainer.held_gib - hm.host_plan(plain, pl).trainer.held_gib
    assert gap == pytest.approx(8 * SHARD)


def test_delta_is_files_only():
    """auto picks files with delta (the plan counts files); delta with transport = collective is
    refused at load in one line naming the field."""
    from hpcrl.runtime import weight_transport

    cfg, pl = seed("--trainer.broadcast.delta")
    assert not hm.host_plan(cfg, pl).collective and weight_transport(cfg, uses_gpus=True) == "filesystem"
    with pytest.raises(ConfigError) as e:
        seed("--trainer.broadcast.transport", "collective", "--trainer.broadcast.delta")
    assert e.value.path == "trainer.broadcast.delta" and "\n" not in str(e.value)
    assert "transport = 'filesystem' or 'auto'" in str(e.value)


def test_vllm_over_files_keeps_a_host_copy_per_worker_only_with_delta():
    """vLLM workers keep the loaded policy as the base of deltas only when the run syncs deltas: with
    delta, 8 workers x 56.9 GiB + 8 x 4 GiB baseline = 487 GiB, refused on 256 GiB naming
    trainer.broadcast.delta; without, each worker holds one tensor while loading (the largest: the
    embedding, 151936 x 2048 x 2 B = 0.58 GiB): 8 x 0.58 + 32 = 36.6 GiB."""
    cfg, pl = seed("--trainer.broadcast.transport", "filesystem", "--trainer.broadcast.delta")
    with pytest.raises(ConfigError) as e:
        hm.dry_run_lines(cfg, pl, node(256))
    assert e.value.path == "trainer.broadcast.delta" and "an inference node needs 487 GiB" in str(e.value)
    cfg, pl = seed("--trainer.broadcast.transport", "filesystem")
    embed = 151936 * 2048 * 2 / GIB
    assert round(embed, 2) == 0.58
    assert hm.host_plan(cfg, pl).inference.total_gib == pytest.approx(8 * embed + 32)
    hm.dry_run_lines(cfg, pl, node(256))  # fits
    # one file per policy (sharded = false): each worker reads the whole dict
    assert hm.server_gib(P, 2, tp=8, vllm=True, collective=False, chunk_mb=256, delta=False) == (
        pytest.approx(8 * 56.87, abs=0.1)
    )
    assert hm.server_gib(
        P, 2, tp=8, vllm=True, collective=False, chunk_mb=256, delta=False, sharded=True,
        largest_tensor=151936 * 2048,
    ) == pytest.approx(8 * embed)  # fmt: skip


def test_no_memory_information_is_not_refused():
    cfg, pl = seed("--no-trainer.broadcast.sharded")
    lines = hm.dry_run_lines(cfg, pl, node(0))
    assert any("trainer node: 487.0 GiB (" in x for x in lines)
    assert hm.dry_run_lines(cfg, pl, None)


def test_slurm_mem_is_the_limit_when_set():
    cfg, pl = seed("--slurm.mem", "128G")
    lines = hm.dry_run_lines(cfg, pl, node(1024))
    assert any("trainer node: 64.4 GiB of 128 GiB" in x for x in lines)
    cfg, pl = seed("--slurm.mem", "64G")
    with pytest.raises(ConfigError) as e:
        hm.dry_run_lines(cfg, pl, node(1024))
    assert "raise slurm.mem" in str(e.value)


@pytest.mark.skipif(shutil.which("sinfo") is None, reason="no SLURM here")
def test_submit_dry_run_prints_the_host_lines(tmp_path):
    """Against the local fake SLURM (scripts/slurm/up.sh --gpus 4: 2 GB nodes): computing on CPU the
    host plan is printed as information, per trainer node and per inference node."""
    from tests.integration.tiny_run import TINY_RL

    cfg = tmp_path / "cfg.toml"
    extra = '[deployment]\nnum_train_gpus = 2\nnum_infer_gpus = 2\ncompute = "cpu"\n'
    cfg.write_text(TINY_RL.format(steps=2) + extra + '[slurm]\ngpus_per_node = 4\ntime = "00:20:00"\n')
    r = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "submit", str(cfg), "--dry-run", "--output-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    out = r.stdout + r.stderr
    if "at most" in out and "(sinfo)" in out:
        pytest.skip("the local SLURM has no fake GPUs")
    assert r.returncode == 0, out[-2000:]
    assert "host memory per node" in out and "trainer node:" in out and "inference node:" in out, out[-2000:]


def test_the_shipped_seed_config_fits_its_1tb_nodes(monkeypatch):
    """configs/hosted/full_ft_multi_node.toml through submit's plan, sinfo answered with seed 000's
    nodes (8 GPUs, 1 TiB); with 256 GiB nodes and `sharded = false` it is refused."""
    from hpcrl.launch import submit

    nodes = [NodeOffer(f"n{i}", 16, 2**20, 8, ("h100",)) for i in range(4)]
    monkeypatch.setattr(submit, "partition_nodes", lambda partition: nodes)
    cfg = load(["configs/hosted/full_ft_multi_node.toml", "--slurm.time", "01:00:00"]).config
    _, lines = submit.slurm_plan(cfg, None)
    assert any("trainer node: 64.4 GiB of 1024 GiB" in x for x in lines)
    assert any("inference node: 34.0 GiB of 1024 GiB" in x for x in lines)
    small = [NodeOffer(f"n{i}", 16, 256 * 1024, 8, ("h100",)) for i in range(4)]
    monkeypatch.setattr(submit, "partition_nodes", lambda partition: small)
    gather = load(
        [
            "configs/hosted/full_ft_multi_node.toml",
            "--slurm.time",
            "01:00:00",
            "--no-trainer.broadcast.sharded",
        ]
    ).config
    with pytest.raises(ConfigError) as e:
        submit.slurm_plan(gather, None)
    assert e.value.path == "trainer.broadcast.sharded"
