"""Trainer checkpoints reshard: state written by N FSDP2 ranks (gloo, CPU) loads on M ranks.

A worker (this file run as a script, torchrun-style environment) builds the tiny model, shards it
with the trainer's ``apply_fsdp``, takes one AdamW step and saves with ``save_trainer_state``; a
second launch with another world size loads that checkpoint with ``load_trainer_state``. Both write
the whole (gathered) model and optimizer state: they must be bitwise equal, and the loaded run must
be able to keep training.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.ranks import run_ranks

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def _run(mode: str, world: int, model_dir: Path, run_dir: Path, out: Path) -> None:
    run_ranks(__file__, world, mode, str(model_dir), str(run_dir), str(out))


def _full_state(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [(2, 1), (1, 2), ("2vp", 1), (1, "2vp"), ("4ep2", "2ep2"), ("2ep2", "4ep2"), ("4ep2", "1moe")],
    ids=[
        "2to1",
        "1to2",
        "2cp-vocab-parallel-to1",
        "1to2cp-vocab-parallel",
        "4ep2-to-2ep2",
        "2ep2-to-4ep2",
        "4ep2-to-1",
    ],
)
def test_checkpoint_reshards(saved, loaded, tiny_model_dir: Path, tmp_path: Path) -> None:
    """``2vp``: 2 ranks under cp = 2 with the vocabulary-parallel embedding / head (its own DTensor,
    not FSDP's): the checkpoint is the same as FSDP's and reshards to and from a plain rank.
    ``Nep2``: a tiny Qwen3-MoE (custom implementation) on N ranks with ep = 2: on 4 ranks each ep
    position's experts are FSDP-sharded over its 2 ranks (2-D DTensors), on 2 they are whole;
    ``1moe``: the same model on one rank without ep."""
    run = tmp_path / "run"
    model_dir = tiny_model_dir
    if "ep2" in f"{saved}{loaded}":
        from hpcrl.models.tiny import build_tiny_model

        model_dir = build_tiny_model(tmp_path / "moe", preset="tiny-moe", seed=0)

    def launch(mode: str, world) -> tuple[str, int]:
        if world == "2vp":
            return mode + "_vp", 2
        if isinstance(world, str):  # "4ep2", "2ep2", "1moe"
            return f"{mode}_{world[1:]}", int(world[0])
        return mode, world

    _run(*launch("save", saved), model_dir, run, tmp_path / "saved.safetensors")
    _run(*launch("load", loaded), model_dir, run, tmp_path / "loaded.safetensors")
    a, b = _full_state(tmp_path / "saved.safetensors"), _full_state(tmp_path / "loaded.safetensors")
    assert sorted(a) == sorted(b) and any(k.startswith("optim.") for k in a)
    import torch

    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_warm_start_optimizer_moments_reshard(tiny_model_dir: Path, tmp_path: Path) -> None:
    """ckpt.warm_start_optimizer on another rank count: a 1-rank checkpoint's AdamW state arrives
    bitwise in a fresh 2-rank FSDP model's optimizer (only the moments: the model stays fresh)."""
    import torch

    run = tmp_path / "run"
    _run("save", 1, tiny_model_dir, run, tmp_path / "saved.safetensors")
    _run("moments", 2, tiny_model_dir, run, tmp_path / "loaded.safetensors")
    a, b = _full_state(tmp_path / "saved.safetensors"), _full_state(tmp_path / "loaded.safetensors")
    optim_keys = sorted(k for k in a if k.startswith("optim."))
    assert optim_keys and optim_keys == sorted(k for k in b if k.startswith("optim."))
    for k in optim_keys:
        assert torch.equal(a[k], b[k]), k
    assert any(not torch.equal(a[k], b[k]) for k in a if k.startswith("model."))  # weights not loaded


def _gathered(model, opt) -> dict:
    import torch

    def full(t):
        return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone().contiguous()

    out = {f"model.{k}": full(v) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    params = [p for g in opt.param_groups for p in g["params"]]
    for i, p in enumerate(params):
        for name, v in opt.state[p].items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{i}.{name}"] = full(v)
    return out


def _worker(mode: str, model_dir: str, run_dir: str, out: str) -> None:
    import torch
    from safetensors.torch import save_file

    from hpcrl.models import parallelize as mp
    from hpcrl.models.spec import load_model
    from hpcrl.paths import RunPaths
    from hpcrl.trainer import optim
    from hpcrl.trainer import parallel as par
    from hpcrl.trainer.state import load_optimizer_moments, load_trainer_state, save_trainer_state

    env = par.init_distributed(torch.device("cpu"))
    torch.manual_seed(0)
    mode, _, flag = mode.partition("_")
    vp = flag == "vp"
    ids = torch.arange(3, 35).reshape(2, 16)
    if vp:  # cp = 2, the embedding and head vocabulary-parallel: the step runs forward_cp
        from hpcrl.models.parallelize import make_cp_group
        from hpcrl.models.parallelize import parallelize as shard_model
        from hpcrl.models.ring_attention import register_hf
        from hpcrl.trainer.context_parallel import forward_cp
        from hpcrl.trainer.packing import PackedBatch

        cp = make_cp_group(2)
        model = shard_model(load_model(model_dir, attn_impl=register_hf()), param_dtype=None, cp=cp)
        flat = ids.reshape(-1)
        mb = PackedBatch(
            input_ids=flat,
            position_ids=torch.arange(16).repeat(2),
            seq_lens=torch.tensor([16, 16]),
            loss_mask=torch.ones(32, dtype=torch.bool),
            advantages=torch.zeros(32),
            inference_logprobs=torch.zeros(32),
        )

        def loss() -> torch.Tensor:
            return forward_cp(model, mb, cp, chunk_tokens=8).logprobs.pow(2).mean()

    elif flag in ("ep2", "moe"):  # the custom Qwen3-MoE, experts over ep = 2 (or whole on one rank)
        from hpcrl.models.qwen3.parallelize import apply_ep

        model = load_model(model_dir, impl="custom")
        experts = apply_ep(model, 2, torch.device("cpu")) if flag == "ep2" else set()
        model = mp.apply_fsdp(model, ignored_params=experts or None)

        def loss() -> torch.Tensor:
            return model(input_ids=ids).logits.float().pow(2).mean()

    else:
        model = mp.apply_fsdp(load_model(model_dir))

        def loss() -> torch.Tensor:
            return model(input_ids=ids).logits.float().pow(2).mean()

    opt = optim.build_optimizer(model, "adamw", lr=1e-2, weight_decay=0.01)
    sched = optim.build_scheduler(opt, "constant", warmup_steps=0, total_steps=10)
    paths = RunPaths(run_dir)

    def step() -> None:
        loss().backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)

    if mode == "save":
        step()
        save_trainer_state(paths, 1, env.rank, env.world_size, model, opt, sched, {"step": 1})
    elif mode == "moments":
        load_optimizer_moments(paths, 1, env.rank, env.world_size, opt)
    else:
        assert load_trainer_state(paths, 1, env.rank, env.world_size, model, opt, sched) == {"step": 1}
    state = _gathered(model, opt)
    if mode in ("load", "moments"):
        step()  # the resharded optimizer state is usable
    if env.rank == 0:
        save_file(state, out)
    par.barrier()
    par.destroy_distributed()


if __name__ == "__main__":
    _worker(*sys.argv[1:5])
    from hpcrl.trainer.parallel import hard_exit

    hard_exit(0)  # as the trainer does: no gloo teardown abort after the work is done


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_run_checkpointed_on_two_ranks_resumes_on_one(tmp_path: Path) -> None:
    """`hpcrl resume --step -1 --deployment.num-trainer-ranks 1` after a 2-rank run was cut off while
    writing checkpoint 3: checkpoint 2 has batch 3 pending (packed for 2 ranks); it is re-packed
    for 1 rank and trained, and the run reaches max_steps."""
    import json

    from hpcrl.paths import RunPaths
    from tests.integration.tiny_run import TINY_RL

    cfg = tmp_path / "cfg.toml"
    cfg.write_text(TINY_RL.format(steps=3))
    out = tmp_path / "run"
    hpcrl = [sys.executable, "-m", "hpcrl.cli"]
    r = subprocess.run(
        [
            *hpcrl,
            "run",
            str(cfg),
            "--output-dir",
            str(out),
            "--ckpt",
            "--ckpt.interval",
            "2",
            "--deployment.num-trainer-ranks",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    paths = RunPaths(out)
    state = json.loads((paths.orchestrator_ckpt_dir(2) / "state.json").read_text())
    assert state["world_size"] == 2 and state["pending_steps"] == [3]
    prompts = paths.prompts_log.read_text().splitlines()
    paths.complete_file(3).unlink()  # as if the job died while writing checkpoint 3
    resume = [*hpcrl, "resume", "--step", "-1", "--output-dir", str(out),
              "--deployment.num-trainer-ranks", "1", "--max-steps", "4"]  # fmt: skip
    # --dry-run first: the plan and the checkpoint it would start from, and not one byte written
    before = {f: f.read_bytes() for f in out.rglob("*") if f.is_file()}
    r = subprocess.run([*resume, "--dry-run"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "hpcrl resume (this machine): dry run OK" in r.stdout
    assert "resume:       from checkpoint step_2 (verified), steps 3..4" in r.stdout
    assert {f: f.read_bytes() for f in out.rglob("*") if f.is_file()} == before
    r = subprocess.run(
        [*resume[:5], "4", *resume[6:], "--dry-run"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and r.stdout.count("\n") + r.stderr.count("\n") <= 2, r.stdout + r.stderr
    assert "not usable" in r.stdout + r.stderr  # step 4 was never written
    r = subprocess.run(resume, capture_output=True, text=True, timeout=280)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "step    4/4" in r.stdout and "hpcrl: run finished" in r.stdout
    assert (
        "resharding checkpoint step_2: written by 2 trainer rank(s), loading on 1"
        in paths.log_file("trainer").read_text()
    )
    assert "pending batches [3] re-packed" in paths.log_file("orchestrator").read_text()
    after = paths.prompts_log.read_text().splitlines()
    assert after[:3] == prompts[:3] and len(after) == 4  # step 3 trained on the same prompts, none repeated
    assert sorted(p.name for p in paths.trainer_ckpt_dir(4).glob("rank_*.json")) == ["rank_0.json"]
