"""Golden-file tests of the rendered hetjob sbatch script (pure: no SLURM needed).

Regenerate the golden files after an intended change with
    UPDATE_GOLDEN=1 pytest tests/integration/test_slurm_render.py
and review the diff.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hpcrl.config.validate import time_seconds
from hpcrl.launch.hetjob import HetComponent, HetJobSpec, HetStep, render_sbatch, validate

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
REPO = "/opt/hpcrl"  # fixed paths keep the golden file machine-independent
RUN = "/scratch/runs/demo"


def spec_2x2() -> HetJobSpec:
    """2 trainer nodes (4 GPUs each) + 2 inference nodes, orchestrator beside trainer rank 0."""
    common = {"partition": "gpu", "account": "proj", "qos": "high", "constraint": "h100", "mem": "0"}
    return HetJobSpec(
        job_name="hpcrl-demo",
        components=[
            HetComponent(
                "trainer", [f"{REPO}/sbatch/trainer.sh"], nodes=2, ntasks_per_node=4, cpus_per_task=8,
                gpus_per_node=4, exclusive=True, **common,
            ),
            HetComponent(
                "inference", [f"{REPO}/sbatch/inference.sh", "--inference.parallel.tp", "2"], nodes=2,
                ntasks_per_node=2, cpus_per_task=16, gpus_per_node=4, forward_signal=False,
                extra_sbatch=["--reservation=infer"], **common,
            ),
        ],
        steps=[HetStep("orchestrator", 0, [f"{REPO}/sbatch/orchestrator.sh"], nodes=1, ntasks=1)],
        time="12:00:00",
        env={"HPCRL_RUN_DIR": RUN, "HPCRL_PYTHON": f"{REPO}/.venv/bin/python"},
        setup=["module load cuda/12.4", f"source {REPO}/.venv/bin/activate"],
        extra_sbatch=["--mail-type=END"],
        signal_before_s=300,
        max_requeues=20,
    )  # fmt: skip


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"{path} missing: run with UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(), f"{name} differs from the golden file (UPDATE_GOLDEN=1 to accept)"


def test_hetjob_2x2_matches_golden():
    check_golden("hetjob_2x2.sbatch", render_sbatch(spec_2x2(), f"{RUN}/logs/slurm"))


def test_render_structure():
    text = render_sbatch(spec_2x2(), f"{RUN}/logs/slurm")
    lines = text.splitlines()
    # job-wide options only before the first component separator
    first_het = lines.index("#SBATCH hetjob")
    assert lines.count("#SBATCH hetjob") == 1
    for opt in ("--signal=B:USR2@300", "--requeue", "--job-name=hpcrl-demo", "--mail-type=END"):
        assert any(opt in ln for ln in lines[:first_het]) and not any(opt in ln for ln in lines[first_het:])
    assert sum(ln.startswith("#SBATCH --time=12:00:00") for ln in lines) == 2  # per component
    assert "#SBATCH --reservation=infer" in lines[first_het:]
    # one srun per step, each in the background, each with a het group and a shell-expanded log dir
    sruns = [ln for ln in lines if ln.startswith("srun ")]
    assert len(sruns) == 3
    assert all(ln.endswith("&") and '--output="$STEP_LOGS/' in ln for ln in sruns)
    assert [ln.split()[1] for ln in sruns] == ["--het-group=0", "--het-group=1", "--het-group=0"]
    assert "--overlap" in sruns[2] and "--relative=0" in sruns[2]
    assert "%j" not in "".join(sruns)  # submitit's %j does not expand inside a het step
    assert "STEP_LOGS=/scratch/runs/demo/logs/slurm/${SLURM_JOB_ID}" in lines
    assert "track_step $! inference 0 1" in lines  # inference does not get the USR2


def test_single_component_and_options():
    spec = HetJobSpec("one", [HetComponent("w", ["true"])], requeue=False, signal_before_s=None, time=30)
    text = render_sbatch(spec, "/tmp/x")
    assert "#SBATCH hetjob" not in text
    assert "#SBATCH --no-requeue" in text and "--signal" not in text
    assert "#SBATCH --time=30" in text


@pytest.mark.parametrize(
    "spec, message",
    [
        (HetJobSpec("j", []), "at least one component"),
        (HetJobSpec("j", [HetComponent("a")]), "nothing to run"),
        (HetJobSpec("j", [HetComponent("a", ["x"]), HetComponent("a", ["y"])]), "unique"),
        (HetJobSpec("j", [HetComponent("bad name", ["x"])]), "name"),
        (HetJobSpec("j", [HetComponent("a", ["x"])], steps=[HetStep("s", 3, ["y"])]), "does not exist"),
        (
            HetJobSpec("j", [HetComponent("a", ["x"], nodes=1)], steps=[HetStep("s", 0, ["y"], nodes=2)]),
            "nodes",
        ),
        (HetJobSpec("j", [HetComponent("a", ["x"])], env={"1X": "v"}), "env name"),
        (HetJobSpec("j", [HetComponent("a", ["x"], extra_sbatch=["-x"])]), "long option"),
        (HetJobSpec("j", [HetComponent("a", ["x"])], time=5, signal_before_s=300), "below the time limit"),
        (HetJobSpec("j", [HetComponent("a", ["x"])], time="1:xx"), "not a SLURM time"),
    ],
)
def test_validate_rejects(spec, message):
    with pytest.raises(ValueError, match=message):
        validate(spec)


@pytest.mark.parametrize(
    "t, seconds",
    [(90, 5400), ("90", 5400), ("5:30", 330), ("01:30:00", 5400), ("1-00:00:00", 86400), ("2-3", 183600),
     ("1-02:03", 93780), ("INFINITE", None)],
)  # fmt: skip
def test_time_seconds(t, seconds):
    assert time_seconds(t) == seconds


def test_rendered_script_is_valid_bash(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    script = tmp_path / "job.sh"
    script.write_text(render_sbatch(spec_2x2(), tmp_path))
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_sbatch_scripts_are_valid_bash():
    sbatch = Path(__file__).resolve().parents[2] / "sbatch"
    scripts = sorted(sbatch.glob("*.sh"))
    assert {p.name for p in scripts} >= {"trainer.sh", "inference.sh", "orchestrator.sh", "common.sh"}
    for p in scripts:
        subprocess.run(["bash", "-n", str(p)], check=True)


def test_spec_from_multi_node_config(tmp_path):
    """The shipped multi-node config -> 2 trainer nodes x 8 ranks + 2 inference nodes x 2 servers."""
    from hpcrl.launch.checks import load
    from hpcrl.launch.placement import slurm_placement
    from hpcrl.launch.slurm import build_spec, render, split_extra_sbatch
    from hpcrl.paths import RunPaths

    cfg_file = Path(__file__).resolve().parents[2] / "configs" / "multi_node" / "rl.toml"
    cfg = load([str(cfg_file), "--output-dir", str(tmp_path / "run")]).config
    paths = RunPaths(tmp_path / "run")
    spec = build_spec(cfg, slurm_placement(cfg), paths, python="/py", scripts=Path("/opt/hpcrl/sbatch"))
    trainer, inference = spec.components
    assert (trainer.nodes, trainer.ntasks_per_node, trainer.gpus_per_node) == (2, 8, 8)
    assert (inference.nodes, inference.ntasks_per_node, inference.gpus_per_node) == (2, 2, 8)
    assert trainer.forward_signal and not inference.forward_signal
    assert spec.steps[0].name == "orchestrator" and spec.steps[0].component == 0
    assert spec.env == {"HPCRL_RUN_DIR": str(paths.root), "HPCRL_PYTHON": "/py"}
    text = render(spec, paths)
    assert text.count("#SBATCH --exclusive") == 2  # a resource option: in every component
    assert f"#SBATCH --output={paths.slurm_logs_dir}/hetjob_%j.log" in text
    assert "/opt/hpcrl/sbatch/trainer.sh &" in text
    assert split_extra_sbatch(["--mail-type=END", "--gres=gpu:8"]) == (["--mail-type=END"], ["--gres=gpu:8"])


def _env_nodes_spec(tmp_path):
    """A CPU job with deployment.env_nodes = 2 on a partition of their own (fixed paths)."""
    from hpcrl.launch.checks import load
    from hpcrl.launch.placement import slurm_placement
    from hpcrl.launch.slurm import build_spec
    from hpcrl.paths import RunPaths
    from tests.conftest import rl_toml

    f = tmp_path / "c.toml"
    f.write_text(
        rl_toml(
            tables='[deployment]\nenv_nodes = 2\nenv_partition = "cpu"\n'
            '[slurm]\ngpus_per_node = 0\npartition = "gpu"\nconstraint = "h100"\njob_name = "envs-demo"\n'
        )
    )
    cfg = load([str(f), "--output-dir", f"{RUN}-envs"]).config
    placement = slurm_placement(cfg, nodes=4)
    return build_spec(cfg, placement, RunPaths(f"{RUN}-envs"), python="/py", scripts=Path(f"{REPO}/sbatch"))


def test_env_nodes_component_matches_golden(tmp_path):
    """deployment.env_nodes: a third component, one env host task per CPU node, no GPU, no USR2."""
    from hpcrl.launch.slurm import render
    from hpcrl.paths import RunPaths

    spec = _env_nodes_spec(tmp_path)
    assert [c.name for c in spec.components] == ["trainer", "inference", "envs"]
    envs = spec.components[2]
    assert (envs.nodes, envs.ntasks_per_node, envs.gpus_per_node) == (2, 1, None)
    assert (envs.partition, envs.constraint, envs.forward_signal) == ("cpu", None, False)
    assert envs.command == [f"{REPO}/sbatch/envs.sh"]
    text = render(spec, RunPaths(f"{RUN}-envs"))
    check_golden("hetjob_env_nodes.sbatch", text)
    assert text.count("#SBATCH hetjob") == 2
    assert "track_step $! envs 0 1" in text
    assert "srun --het-group=2 " in text and "HPCRL_STEP=envs,HPCRL_COMPONENT_INDEX=2" in text
