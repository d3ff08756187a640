"""The dry-run host-memory plan (hpcrl.launch.host_memory): numbers checked by hand for seed 000's
layout, Qwen3-30B-A3B on 2 trainer + 2 inference nodes x 8 GPUs, under the protocol-4 weight sync
(issue 49: pieces cast and sent lazily from the GPU; no server keeps a delta base)."""

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


EMBED = 151936 * 2048 * 2 / GIB  # the largest tensor, bf16: 0.58 GiB


def test_per_rank_figures_by_hand():
    """The protocol-4 weight sync (issue 49): pieces are cast and sent lazily from the GPU, so the
    collective holds nothing on the host, the filesystem one bucket (+ the pieces to diff and the delta
    base (previous shard) with delta)."""
    assert round(P * 2 / GIB, 2) == 56.87
    assert round(SHARD, 3) == 3.554
    assert round(EMBED, 2) == 0.58
    fs = dict(collective=False, bucket_mb=256)
    # sharded filesystem: one bucket of 256 MiB
    assert hm.trainer_rank_gib(P, 16, 2, **fs) == pytest.approx(0.25)
    # delta: + this rank's pieces to diff (S) + the delta base (previous shard) (S)
    assert hm.trainer_rank_gib(P, 16, 2, delta=True, **fs) == pytest.approx(0.25 + 2 * SHARD)  # 7.36
    # collective: sent from the GPU (the GPU plan's weight publish): 0 on the host, rank 0 too ...
    assert hm.trainer_rank_gib(P, 16, 2, collective=True, rank0=True, hf_weights=False) == 0
    # ... unless a checkpoint's HF export (one 1 GiB file on rank 0) is larger
    assert hm.trainer_rank_gib(P, 16, 2, collective=True, rank0=True) == pytest.approx(1.0)
    # the gathered path: the whole policy on every rank, and the previous one on rank 0 with delta
    assert hm.trainer_rank_gib(P, 16, 2, sharded=False) == pytest.approx(56.87, abs=0.01)
    assert hm.trainer_rank_gib(P, 16, 2, sharded=False, delta=True, rank0=True) == pytest.approx(
        2 * 56.87, abs=0.02
    )
    # a checkpoint's HF export: rank 0 holds one 1 GiB file + the largest tensor; the publish is smaller
    big = hm.trainer_rank_gib(P, 1024, 2, rank0=True, largest_tensor=151936 * 2048)
    assert big == pytest.approx(1 + EMBED)  # 1.58 GiB > one 0.25 GiB bucket
    # inference over the collective: received on the GPU (the GPU plan's weight receive), 0 here
    assert hm.server_gib(P, 2, tp=8, vllm=True, collective=True) == 0
    assert hm.server_gib(P, 2, tp=8, vllm=False, collective=True) == 0
    # files: every vLLM worker assembles one whole tensor (the largest) for load_weights: 8 x 0.58
    got = hm.server_gib(P, 2, tp=8, vllm=True, collective=False, largest_tensor=151936 * 2048)
    assert got == pytest.approx(8 * EMBED)
    # the hf engine copies each piece into its parameters: one piece, at most a bucket
    assert hm.server_gib(P, 2, tp=8, vllm=False, collective=False, bucket_mb=256) == 0.25
    # one file per policy (sharded = false): the whole dict in every worker / the hf engine
    assert hm.server_gib(P, 2, tp=8, vllm=True, collective=False, sharded=False) == pytest.approx(
        8 * 56.87, abs=0.1
    )
    assert hm.server_gib(P, 2, tp=8, vllm=False, collective=False, sharded=False) == pytest.approx(
        56.87, abs=0.01
    )


def test_seed_layout_sharded_fits_a_1tb_node():
    cfg, pl = seed()
    lines = hm.dry_run_lines(cfg, pl, node(1024))
    plan = hm.host_plan(cfg, pl)
    # collective (auto on GPUs): the syncs hold nothing on the host; 8 processes x 4 GiB baseline a node
    assert plan.collective and plan.trainer.held_gib == 0 and plan.inference.held_gib == 0
    assert plan.trainer.total_gib == plan.inference.total_gib == 8 * hm.PROCESS_BASE_GIB == 32.0
    assert any("trainer node: 32.0 GiB of 1024 GiB" in x and "pieces sent from the GPU" in x for x in lines)
    assert any("inference node: 32.0 GiB of 1024 GiB" in x and "received on the GPU" in x for x in lines)


def test_gather_every_rank_is_refused_on_a_256gb_node():
    cfg, pl = seed("--no-trainer.broadcast.sharded")
    assert hm.host_plan(cfg, pl).trainer.total_gib == pytest.approx(8 * 56.87 + 32, abs=0.1)  # 487 GiB
    with pytest.raises(ConfigError) as e:
        hm.dry_run_lines(cfg, pl, node(256))
    assert e.value.path == "trainer.broadcast.sharded" and "\n" not in str(e.value)
    assert "487 GiB" in str(e.value) and "has 256 GiB" in str(e.value)
    hm.dry_run_lines(cfg, pl, node(1024))  # 487 GiB in 1 TB: fits


def test_delta_adds_the_pieces_and_the_previous_shard():
    plain, pl = seed("--trainer.broadcast.transport", "filesystem")
    delta, _ = seed("--trainer.broadcast.transport", "filesystem", "--trainer.broadcast.delta")
    assert hm.host_plan(plain, pl).trainer.held_gib == pytest.approx(8 * 0.25)  # 8 ranks x one bucket
    got = hm.host_plan(delta, pl).trainer
    gap = got.held_gib - hm.host_plan(plain, pl).trainer.held_gib
    assert gap == pytest.approx(8 * 2 * SHARD)  # each rank: its pieces to diff + the previous shard
    assert got.total_gib == pytest.approx(8 * (0.25 + 2 * SHARD) + 32)  # 90.9 GiB
    assert "delta base (previous shard) 3.55" in got.note


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


def test_delta_with_vllm_is_refused_and_no_server_keeps_a_base():
    """vLLM cannot apply a delta in place (its parameters are fused and sharded): delta with
    inference.backend = "vllm" is refused at load naming trainer.broadcast.delta. The hf engine applies
    it in place to the parameters it serves, so no server counts a delta base: with backend "auto" on
    GPUs (vLLM workers reading files) the inference node holds 8 workers x the largest tensor,
    8 x 0.58 + 32 = 36.6 GiB (before issue 49: 8 x 56.9 + 32 = 487 GiB, every worker's `_hpcrl_full`)."""
    with pytest.raises(ConfigError) as e:
        seed("--inference.backend", "vllm", "--trainer.broadcast.delta")
    assert e.value.path == "trainer.broadcast.delta" and "\n" not in str(e.value)
    assert "vLLM" in str(e.value) and "inference.backend = 'hf'" in str(e.value)
    cfg, pl = seed("--trainer.broadcast.delta")  # auto: files, vLLM on GPUs
    plan = hm.host_plan(cfg, pl)
    assert plan.inference.held_gib == pytest.approx(8 * EMBED)
    assert plan.inference.total_gib == pytest.approx(8 * EMBED + 32)  # 36.6 GiB, not 487
    hm.dry_run_lines(cfg, pl, node(256))  # fits
    same, _ = seed("--trainer.broadcast.transport", "filesystem")  # delta changes nothing on a server
    assert hm.host_plan(same, pl).inference.held_gib == plan.inference.held_gib
    hf, hpl = seed("--inference.backend", "hf", "--trainer.broadcast.delta")
    assert hm.host_plan(hf, hpl).inference.held_gib == 0.25  # one server of one process: one piece


def test_no_memory_information_is_not_refused():
    cfg, pl = seed("--no-trainer.broadcast.sharded")
    lines = hm.dry_run_lines(cfg, pl, node(0))
    assert any("trainer node: 487.0 GiB (" in x for x in lines)
    assert hm.dry_run_lines(cfg, pl, None)


def test_slurm_mem_is_the_limit_when_set():
    cfg, pl = seed("--slurm.mem", "128G")
    lines = hm.dry_run_lines(cfg, pl, node(1024))
    assert any("trainer node: 32.0 GiB of 128 GiB" in x for x in lines)
    cfg, pl = seed("--slurm.mem", "24G")
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
    assert any("trainer node: 32.0 GiB of 1024 GiB" in x for x in lines)
    assert any("inference node: 32.0 GiB of 1024 GiB" in x for x in lines)
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
