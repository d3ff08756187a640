"""Seed 000's multi-node example (2 train + 2 inference nodes x 8 GPUs; impl custom, ep 8,
flash_attention_3, tp 8) through `hpcrl submit --dry-run` on the GPU-shaped SLURM
(`sudo bash scripts/slurm/up.sh --gpus 8 --cpus 16 --mem 1048576`): the placement plan, the memory plan,
the host-memory plan per node and the ep groups print, and sbatch --test-only accepts the job.

configs/hosted/full_ft_multi_node.toml is that example (impl custom, ep 8, flash_attention_3, tp 8).
The full_finetune shape turns activation checkpointing on unless told otherwise, and the trainer
computes logprobs in chunks: at seq_len 32768 a trainer rank would need ~377 GiB without either.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.launch.partition import partition_nodes
from tests.integration.test_slurm_cluster import cluster  # noqa: F401

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[2]
SEED: list[str] = []


@pytest.fixture(scope="module")
def seed_cluster(cluster):  # noqa: F811
    nodes = partition_nodes(None) or []
    if len([n for n in nodes if n.gpus >= 8 and n.cpus >= 16 and n.mem_mb >= 2**20]) < 4:
        why = "needs 4 nodes x 8 fake GPUs x 16 CPUs x 1 TiB (sudo bash scripts/slurm/up.sh --gpus 8 --cpus 16 --mem 1048576)"
        if os.environ.get("HPCRL_SEED000_CLUSTER"):  # scripts/test.sh shaped the cluster for this test
            pytest.fail(why)
        pytest.skip(why)


def test_seed000_multi_node_dry_run_prints_plan_memory_and_ep_groups(seed_cluster, tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "hpcrl.cli", "submit", str(REPO / "configs/hosted/full_ft_multi_node.toml"),
         *SEED, "--dry-run", "--output-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    # placement: 16 trainer ranks on 2 nodes, 2 inference servers at tp 8
    assert "trainer:      16 rank(s) on 2 node(s), 1 GPU each" in out
    assert "inference:    2 server(s) on 2 node(s), 8 GPU(s) each (tp)" in out
    assert (
        "trainer node 1: rank 8 -> GPU 0" in out
        and "inference node 1: server 1 -> GPU 0,1,2,3,4,5,6,7" in out
    )
    # memory plan: Qwen3-30B-A3B's numbers, a trainer rank under FSDP 16 x ep 8 within 80 GiB
    assert "memory plan:  Qwen/Qwen3-30B-A3B-Thinking-2507: 30.53 B params" in out
    assert "trainer rank (16 ranks, FSDP 16, ep 8; bf16 compute, fp32 master)" in out and " of 80 GiB" in out
    assert "inference GPU (tp 8, bf16" in out and "KV cache" in out
    # ep groups: one per trainer node
    # the weight sync on the GPUs (protocol 4): docs/memory.md's figures
    assert "weight publish bf16      0.18 GiB" in out and "weight receive bf16      1.33 GiB" in out
    # host memory per node at a weight sync (sharded, collective: sent and received on the GPUs)
    assert "trainer node: 32.0 GiB of 1024 GiB" in out and "inference node: 32.0 GiB of 1024 GiB" in out
    assert "ep groups:  2 x 8 ranks" in out and "[0-7] [8-15]" in out
    assert "sbatch --test-only: OK" in out
