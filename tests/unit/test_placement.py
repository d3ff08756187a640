"""Placement: which process gets which GPUs, what the job requests, how a process binds itself.

Numbers are hand-checked: e.g. 2 trainer GPUs + 4 inference GPUs at tp 2 on 4-GPU nodes = trainer
node ranks 0,1 -> GPU 0 / GPU 1; inference node servers 0,1 -> GPUs 0,1 / 2,3.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpcrl.errors import ConfigError
from hpcrl.launch.checks import load
from hpcrl.launch.placement import local_placement, slurm_placement
from hpcrl.paths import RunPaths
from hpcrl.runtime import bind_gpus, placement_line, rank_env, read_records, record, select_gpus

REPO = Path(__file__).resolve().parents[2]
BASE = ["--model.name", "hpcrl/tiny-qwen3", "--orchestrator.train.env", '[{id = "reverse-text"}]']


def cfg_of(*args: str, slurm: bool = True):
    extra = ["--slurm.time", "01:00:00"] if slurm else []
    return load([*BASE, *extra, *args]).config


def gpu_sets(p, role):
    n = p.trainer_ranks if role == "trainer" else p.inference_servers
    slot = p.trainer_slot if role == "trainer" else p.server_slot
    return [(slot(i).node, slot(i).gpus) for i in range(n)]


def test_slurm_gpu_counts_two_trainer_gpus_and_two_tp2_servers():
    cfg = cfg_of(
        "--deployment.num-train-gpus",
        "2",
        "--deployment.num-infer-gpus",
        "4",
        "--inference.parallel.tp",
        "2",
        "--slurm.gpus-per-node",
        "4",
    )
    p = slurm_placement(cfg)
    assert (p.train_nodes, p.infer_nodes, p.trainer_ranks, p.inference_servers) == (1, 1, 2, 2)
    assert gpu_sets(p, "trainer") == [(0, (0,)), (0, (1,))]
    assert gpu_sets(p, "inference") == [(0, (0, 1)), (0, (2, 3))]
    assert p.resources("trainer") == {"nodes": 1, "ntasks_per_node": 2, "gpus_per_node": 2}
    assert p.resources("inference") == {"nodes": 1, "ntasks_per_node": 2, "gpus_per_node": 4}


def test_hosted_single_node_config_requests_one_gpu_each():
    cfg = load([str(REPO / "configs/hosted/full_ft_single_node.toml")]).config
    p = slurm_placement(cfg)
    assert p.resources("trainer")["gpus_per_node"] == 1 and p.resources("trainer")["ntasks_per_node"] == 1
    assert p.resources("inference")["gpus_per_node"] == 1 and p.resources("inference")["ntasks_per_node"] == 1
    assert (p.trainer_ranks, p.inference_servers) == (1, 1)


def test_multi_node_config_whole_nodes():
    cfg = load([str(REPO / "configs/multi_node/rl.toml")]).config  # 2+2 nodes x 8 GPUs, tp 4
    p = slurm_placement(cfg)
    assert (p.trainer_ranks, p.inference_servers) == (16, 4)
    assert p.trainer_slot(9).node == 1 and p.trainer_slot(9).gpus == (1,)
    assert [p.server_slot(i).gpus for i in range(4)] == [(0, 1, 2, 3), (4, 5, 6, 7)] * 2
    assert p.server_slot(3).node == 1


def test_no_gpu_shared_and_none_idle():
    for tg, ig, tp, gpn in [(1, 1, 1, 8), (2, 4, 2, 4), (8, 8, 4, 8), (16, 8, 8, 8), (3, 6, 3, 8)]:
        cfg = cfg_of(
            "--deployment.num-train-gpus",
            str(tg),
            "--deployment.num-infer-gpus",
            str(ig),
            "--inference.parallel.tp",
            str(tp),
            "--slurm.gpus-per-node",
            str(gpn),
            "--deployment.gpus-per-node",
            "64",
        )
        p = slurm_placement(cfg)
        for role in ("trainer", "inference"):
            used = [(node, g) for node, gpus in gpu_sets(p, role) for g in gpus]
            assert len(used) == len(set(used)), (role, used)  # nothing shared
            req = p.resources(role)
            assert len(used) == req["nodes"] * req["gpus_per_node"], (role, used, req)  # nothing idle


def test_local_gpu_machine_trainer_first_then_servers():
    cfg = cfg_of(
        "--deployment.num-train-gpus",
        "2",
        "--deployment.num-infer-gpus",
        "4",
        "--inference.parallel.tp",
        "2",
        slurm=False,
    )
    p = local_placement(cfg, gpus_available=8)
    assert [s.gpus for s in p.slots()] == [(0,), (1,), (2, 3), (4, 5)]
    with pytest.raises(ConfigError, match="deployment.num_train_gpus"):
        local_placement(cfg, gpus_available=4)


def test_local_cpu_placement_has_no_gpus():
    p = local_placement(cfg_of(slurm=False), gpus_available=0)
    assert not p.uses_gpus and [s.gpus for s in p.slots()] == [(), ()]


@pytest.mark.parametrize(
    "args, field, words",
    [
        (
            [
                "--deployment.num-train-gpus",
                "1",
                "--deployment.num-infer-gpus",
                "6",
                "--inference.parallel.tp",
                "3",
                "--slurm.gpus-per-node",
                "4",
            ],
            "deployment.num_infer_gpus",
            "whole nodes",
        ),
        (
            [
                "--deployment.num-train-nodes",
                "1",
                "--deployment.num-infer-nodes",
                "1",
                "--deployment.gpus-per-node",
                "6",
                "--inference.parallel.tp",
                "4",
                "--slurm.gpus-per-node",
                "6",
            ],
            "inference.parallel.tp",
            "does not divide",
        ),
        (
            [
                "--deployment.num-train-nodes",
                "1",
                "--deployment.num-infer-nodes",
                "1",
                "--inference.parallel.tp",
                "8",
                "--deployment.gpus-per-node",
                "4",
                "--slurm.gpus-per-node",
                "4",
            ],
            "inference.parallel.tp",
            "does not divide",
        ),
    ],
)
def test_impossible_layouts_name_the_field(args, field, words):
    with pytest.raises(ConfigError) as e:
        slurm_placement(cfg_of(*args))
    assert e.value.path == field and words in str(e.value)


def test_more_gpus_per_node_than_the_partition_has():
    cfg = cfg_of(
        "--deployment.num-train-nodes", "1", "--deployment.num-infer-nodes", "1", "--slurm.gpus-per-node", "8"
    )
    with pytest.raises(ConfigError) as e:
        slurm_placement(cfg, partition_gpus=4)
    assert e.value.path == "slurm.gpus_per_node" and "at most 4 (sinfo)" in str(e.value)
    assert slurm_placement(cfg, partition_gpus=8).trainer_ranks == 8


@pytest.mark.parametrize(
    "visible, need, local, kept",
    [
        (["0", "1"], 1, 1, ["1"]),  # --gpus-per-node: rank 1 of the node keeps GPU 1
        (["0", "1", "2", "3"], 2, 1, ["2", "3"]),  # server 1 of a 4-GPU node at tp 2
        (["3"], 1, 5, ["3"]),  # already bound (local launcher, --gpus-per-task): kept as is
        (["0", "1", "2", "3"], 0, 0, []),  # the orchestrator owns no GPU
    ],
)
def test_select_gpus(visible, need, local, kept):
    assert select_gpus(visible, need, local) == kept


def test_select_gpus_mismatch_is_a_clear_error():
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=0,1,2"):
        select_gpus(["0", "1", "2"], 2, 1)


def test_bind_gpus_narrows_by_slurm_localid():
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "HPCRL_GPUS_PER_TASK": "2", "SLURM_LOCALID": "1"}
    assert bind_gpus(env) == ["2", "3"] and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    untouched = {"CUDA_VISIBLE_DEVICES": "0,1"}  # no placement given: leave it
    assert bind_gpus(untouched) == ["0", "1"] and untouched["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_rank_env_is_the_torchrun_layout():
    assert rank_env(1, 3, "10.0.0.5", 29400) == {
        "RANK": "1",
        "WORLD_SIZE": "3",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "3",
        "MASTER_ADDR": "10.0.0.5",
        "MASTER_PORT": "29400",
    }
    # rank 5 of 8 on the second of two 4-rank nodes: local rank 1 of 4
    two_nodes = rank_env(5, 8, "n1", 29500, local_rank=1, local_world=4)
    assert (two_nodes["RANK"], two_nodes["LOCAL_RANK"], two_nodes["LOCAL_WORLD_SIZE"]) == ("5", "1", "4")


def test_rank_env_is_what_the_trainer_reads_and_binds_by():
    from hpcrl.trainer.parallel import DistEnv, dist_env

    assert dist_env(rank_env(2, 4, "127.0.0.1", 1234)) == DistEnv(
        rank=2, world_size=4, local_rank=2, master_addr="127.0.0.1", master_port=1234
    )
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "HPCRL_GPUS_PER_TASK": "2", **rank_env(1, 2, "h", 1)}
    assert bind_gpus(env) == ["2", "3"]  # LOCAL_RANK 1 takes the second pair


@pytest.mark.parametrize(
    "args, kw, match",
    [
        ((2, 2, "h", 1), {}, "rank 2 .* world of 2"),
        ((-1, 2, "h", 1), {}, "rank -1"),
        ((1, 4, "h", 1), {"local_rank": 2, "local_world": 2}, "local 2 of 2"),
        ((1, 2, "h", 1), {"local_world": 3}, "local 1 of 3"),
        ((0, 1, "h", 0), {}, "master port 0"),
        ((0, 1, "h", 65536), {}, "master port 65536"),
    ],
)
def test_rank_env_refuses_a_rank_outside_its_world(args, kw, match):
    with pytest.raises(ValueError, match=match):
        rank_env(*args, **kw)


def test_record_appends_a_line_and_keeps_the_newest(tmp_path, monkeypatch):
    paths = RunPaths(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    record(paths, "inference", 1, port=8001)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    record(paths, "trainer", 0, port=29500)
    record(paths, "trainer", 0, port=29501)
    lines = paths.placement_log.read_text().splitlines()
    assert len(lines) == 3
    recs = read_records(paths)
    assert [(r["role"], r["rank"], r["gpus"], r["port"], r["node"]) for r in recs] == [
        ("trainer", 0, [0], 29501, "n2"),
        ("inference", 1, [2, 3], 8001, "n2"),
    ]
    line = placement_line("orchestrator", 0, environ={})
    assert set(line) >= {"role", "rank", "node", "gpus", "host", "port"} and line["gpus"] == []


def test_local_launcher_gives_each_child_its_slot():
    from hpcrl.launch.local import _gpu_env

    cfg = cfg_of("--deployment.num-train-gpus", "2", "--deployment.num-infer-gpus", "2", slurm=False)
    p = local_placement(cfg, gpus_available=4)
    assert _gpu_env(p, p.trainer_slot(1)) == {"CUDA_VISIBLE_DEVICES": "1", "HPCRL_GPUS_PER_TASK": "1"}
    assert _gpu_env(p, p.server_slot(1)) == {"CUDA_VISIBLE_DEVICES": "3", "HPCRL_GPUS_PER_TASK": "1"}
    assert _gpu_env(local_placement(cfg, 0), p.trainer_slot(0)) == {}


@pytest.mark.parametrize(
    "count, local_rank, compute, expected",
    [
        (1, 3, None, "cuda:0"),  # bound to its one GPU: cuda:0, never cuda:LOCAL_RANK (the old crash)
        (4, 3, None, "cuda:3"),  # a node's whole GPU list: its local rank
        (4, 3, "cpu", "cpu"),  # deployment.compute = "cpu"
        (0, 0, None, "cpu"),
    ],
)
def test_trainer_device(monkeypatch, count, local_rank, compute, expected):
    import torch

    from hpcrl.trainer.parallel import device_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.delenv("HPCRL_COMPUTE", raising=False)
    if compute:
        monkeypatch.setenv("HPCRL_COMPUTE", compute)
    assert str(device_for(local_rank)) == expected


def test_weight_transport_one_rule_for_launcher_and_hand_started_roles(monkeypatch):
    """trainer.broadcast.transport = "auto": collective when the trainer computes on GPUs, files on
    CPU. The launcher decides from its placement and records it; a role started by hand (the
    orchestrator's deployment(), the trainer) asks the same function about its own process."""
    from hpcrl.launch import prepare
    from hpcrl.orchestrator.setup import deployment
    from hpcrl.runtime import weight_transport

    cfg = cfg_of(slurm=False)
    assert cfg.trainer.broadcast.transport == "auto"
    assert weight_transport(cfg, uses_gpus=True) == "collective"
    assert weight_transport(cfg, uses_gpus=False) == "filesystem"
    monkeypatch.setenv("HPCRL_COMPUTE", "cpu")  # what deployment.compute = "cpu" sets for its children
    assert weight_transport(cfg) == "filesystem" == deployment(cfg)[2]
    explicit = cfg_of("--trainer.broadcast.transport", "collective", slurm=False)
    assert weight_transport(explicit, uses_gpus=False) == "collective" == deployment(explicit)[2]
    gpu_plan = local_placement(
        cfg_of("--deployment.num-train-gpus", "1", "--deployment.num-infer-gpus", "1", slurm=False), 2
    )
    prepare.apply_placement(cfg, gpu_plan)
    assert cfg.trainer.broadcast.transport == "collective" == deployment(cfg)[2]
