"""Node resources at submit: sinfo parsing and the per-component CPU / memory checks (pure)."""

from __future__ import annotations

import pytest

from hpcrl.errors import ConfigError
from hpcrl.launch.partition import (
    ComponentRequest,
    NodeOffer,
    check_components,
    component_requests,
    gres_gpus,
    parse_mem_mb,
    parse_sinfo,
)
from hpcrl.launch.placement import slurm_placement
from tests.unit.test_placement import cfg_of

# What `sinfo -h -N -o '%N|%c|%m|%G'` printed on the fake-node cluster (up.sh --gpus 4), with n1
# listed twice (a node in two partitions) and a junk line.
SINFO = "n1|2|2048|gpu:4\nn1|2|2048|gpu:4\nn2|2|2048|gpu:4\nn3|16|64000|gpu:a100:8(S:0-1)\nbad line\n"
FAKE = [NodeOffer(f"n{i}", 2, 2048, 4) for i in range(1, 5)]
WHERE = "the default partition"


@pytest.mark.parametrize(
    "gres, n",
    [
        ("gpu:4", 4),
        ("gpu:a100:8(S:0-1)", 8),
        ("gpu:2,shard:8", 2),
        ("(null)", 0),
        ("gpu:h100:4,gpu:a100:2", 6),
    ],
)
def test_gres_parsing(gres, n):
    assert gres_gpus(gres) == n


def test_sinfo_nodes_once_each():
    assert parse_sinfo(SINFO) == [
        NodeOffer("n1", 2, 2048, 4),
        NodeOffer("n2", 2, 2048, 4),
        NodeOffer("n3", 16, 64000, 8, ("a100",)),
    ]


def test_gres_gpu_types():
    from hpcrl.launch.partition import gres_gpu_types

    assert gres_gpu_types("gpu:h100:8(S:0-1),shard:4") == ("h100",)
    assert gres_gpu_types("gpu:4") == () and gres_gpu_types("(null)") == ()


@pytest.mark.parametrize(
    "mem, mb", [("0", 0), ("2048", 2048), ("512M", 512), ("64G", 65536), ("1T", 1048576)]
)
def test_mem_syntax(mem, mb):
    assert parse_mem_mb(mem) == mb


def test_mem_syntax_refused():
    with pytest.raises(ConfigError) as e:
        parse_mem_mb("lots")
    assert e.value.path == "slurm.mem"


def req(role="trainer", nodes=1, tasks=2, cpt=1, mem=None, gpus=2, field="slurm.gpus_per_node"):
    return ComponentRequest(role, nodes, tasks, cpt, mem, gpus, field)


def refused(reqs, nodes=FAKE) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        check_components(reqs, nodes, WHERE)
    assert "\n" not in str(e.value)
    return e.value


def test_what_fits_passes():
    check_components([req(), req("inference", tasks=1, cpt=2, mem=2048)], FAKE, WHERE)
    check_components([req(mem=0, tasks=2, gpus=4)], FAKE, WHERE)  # mem 0 = all of the node


def test_too_many_tasks_names_the_tasks_field():
    e = refused([req(tasks=4, gpus=4)])
    assert e.path == "slurm.gpus_per_node"
    assert "trainer component asks 4 task(s) x 1 CPU(s) = 4 CPUs per node" in e.message
    assert "at most 2 CPUs (sinfo)" in e.message


def test_too_many_cpus_per_task_names_cpus_per_task():
    e = refused(
        [req("inference", tasks=2, cpt=2, field="deployment.num_infer_gpus or inference.parallel.tp")]
    )
    assert e.path == "slurm.cpus_per_task"
    assert "inference component asks 2 task(s) x 2 CPU(s) = 4 CPUs" in e.message and "to 1" in e.message
    # tasks alone exceed the node: the tasks field is the one to change, cpus_per_task mentioned too
    e = refused(
        [req("inference", tasks=3, cpt=2, field="deployment.num_infer_gpus or inference.parallel.tp")]
    )
    assert e.path == "deployment.num_infer_gpus" and "or lower slurm.cpus_per_task" in e.message


def test_too_much_memory_names_slurm_mem():
    e = refused([req(mem=4096)])
    assert e.path == "slurm.mem" and "asks 4096 MB per node" in e.message and "at most 2048 MB" in e.message


def test_components_never_share_a_node():
    mixed = [NodeOffer("big", 16, 64000, 8), NodeOffer("small", 2, 2048, 4)]
    check_components([req(tasks=8, gpus=8), req("inference", tasks=2, gpus=4)], mixed, WHERE)
    # both need the one big node
    e = refused([req(tasks=8, gpus=8), req("inference", tasks=4, gpus=4)], mixed)
    assert e.path == "--nodes" and "inference component needs 1 node(s) with 4 CPUs, 4 GPUs" in e.message
    e = refused([req(nodes=3), req("inference", nodes=2)])
    assert "inference component needs 2 node(s)" in e.message and "has 1 more" in e.message


def test_requests_follow_the_placement():
    cfg = cfg_of(
        "--deployment.num-train-nodes", "1", "--deployment.num-infer-nodes", "1",
        "--slurm.gpus-per-node", "4", "--inference.parallel.tp", "2",
        "--slurm.cpus-per-task", "3", "--slurm.mem", "8G",
    )  # fmt: skip
    trainer, inference = component_requests(cfg, slurm_placement(cfg))
    assert (trainer.ntasks_per_node, trainer.cpus_per_task, trainer.mem_mb, trainer.gpus_per_node) == (
        4,
        3,
        8192,
        4,
    )
    assert trainer.tasks_field == "slurm.gpus_per_node"
    assert (inference.ntasks_per_node, inference.gpus_per_node) == (2, 4)
    assert inference.tasks_field == "slurm.gpus_per_node or inference.parallel.tp"


def test_memory_from_extra_sbatch_and_cpu_nodes():
    cfg = cfg_of(
        "--deployment.num-train-nodes", "1", "--deployment.num-infer-nodes", "1",
        "--slurm.gpus-per-node", "2", "--slurm.cpus-per-task", "2", "--slurm.mem", "1G",
        "--slurm.extra-sbatch", '["--mem-per-cpu=600M", "--exclusive"]',
    )  # fmt: skip
    trainer, _ = component_requests(cfg, slurm_placement(cfg))
    assert trainer.mem_mb == 600 * 2 * 2 and trainer.mem_field == "slurm.extra_sbatch (--mem-per-cpu)"
    e = refused([trainer], [NodeOffer("n1", 4, 2048, 4)])
    assert e.path == "slurm.extra_sbatch" and "asks 2400 MB per node" in e.message
    cpu = cfg_of("--slurm.nodes", "2", "--slurm.gpus-per-node", "0", "--deployment.num-trainer-ranks", "3")
    trainer, inference = component_requests(cpu, slurm_placement(cpu, nodes=2))
    assert (trainer.ntasks_per_node, trainer.gpus_per_node, trainer.tasks_field) == (
        3, 0, "deployment.num_trainer_ranks",
    )  # fmt: skip
    assert refused([trainer]).path == "deployment.num_trainer_ranks"


def test_env_nodes_count_against_the_partition_unless_they_have_their_own():
    cfg = cfg_of("--slurm.gpus-per-node", "0", "--deployment.env-nodes", "3")
    reqs = component_requests(cfg, slurm_placement(cfg, nodes=5))
    assert [(r.role, r.nodes, r.ntasks_per_node, r.gpus_per_node) for r in reqs] == [
        ("trainer", 1, 1, 0), ("inference", 1, 1, 0), ("envs", 3, 1, 0),
    ]  # fmt: skip
    e = refused(reqs)  # 4 fake nodes: the envs component gets the 2 left
    assert e.path == "deployment.env_nodes" and "envs component needs 3 node(s)" in e.message
    own = cfg_of(
        "--slurm.gpus-per-node", "0", "--deployment.env-nodes", "3", "--deployment.env-partition", "cpu"
    )
    assert [r.role for r in component_requests(own, slurm_placement(own, nodes=5))] == [
        "trainer",
        "inference",
    ]
