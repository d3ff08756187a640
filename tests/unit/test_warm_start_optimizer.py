"""ckpt.warm_start_optimizer: a warm start that also carries the source run's AdamW state over.

Run A trains a tiny model two real steps and checkpoints step 2 through the real Checkpointer; run B
warm-starts from it. With the flag, B's optimizer holds exactly A's saved exp_avg / exp_avg_sq (and
step counters) before its first step, keeps its own lr and a fresh scheduler at step 0, and trains a
step; without it, B's optimizer state is empty. References that hold no optimizer state, and a
different adapter shape, are refused with one line naming the field."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpcrl import checkpoint as ck
from hpcrl.config.schema import CkptConfig, TrainerModelConfig
from hpcrl.errors import ConfigError
from hpcrl.models.load import LoraParams
from hpcrl.models.spec import load_model
from hpcrl.models.tokenizer import load_tokenizer
from hpcrl.paths import RunPaths
from hpcrl.trainer import optim, precision
from hpcrl.trainer.checkpointer import Checkpointer
from hpcrl.trainer.core import Progress
from hpcrl.trainer.parallel import DistEnv
from hpcrl.trainer.setup import Training
from tests.conftest import rl_toml


def _training(model_dir: Path, lr: float, lora: LoraParams | None = None) -> Training:
    model = load_model(model_dir, lora=lora)
    opt = optim.build_optimizer(model, "adamw", lr=lr)
    return Training(
        model,
        load_tokenizer(model_dir),
        opt,
        optim.build_scheduler(opt, "cosine", warmup_steps=2, total_steps=10),
        torch.device("cpu"),
        str(model_dir),
        DistEnv(0, 1, 0, "127.0.0.1", 0),
        precision.of_model(TrainerModelConfig(), on_gpu=False),
    )


def _train_step(tr: Training, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, tr.model.config.vocab_size, (2, 12), generator=g)
    tr.model(input_ids=ids, labels=ids).loss.backward()
    tr.optimizer.step()
    tr.scheduler.step()
    tr.optimizer.zero_grad()


@pytest.fixture(scope="module")
def source(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> RunPaths:
    """Run A: two steps, checkpoint step 2 complete (trainer part only, as SFT writes it)."""
    paths = RunPaths(tmp_path_factory.mktemp("a") / "run")
    paths.make_dirs()
    tr = _training(tiny_model_dir, lr=1e-3)
    for s in (1, 2):
        _train_step(tr, s)
    c = Checkpointer(CkptConfig(), paths, tr, max_steps=2, parts=("trainer",))
    c.save(2, Progress(step=2))
    c.close()
    assert ck.verify(paths, 2) is None
    return paths


def _restore(model_dir: Path, tmp: Path, ref: str, carry: bool, **kw) -> tuple[Training, int, Progress]:
    paths = RunPaths(tmp / "b")
    paths.make_dirs()
    tr = _training(model_dir, lr=5e-4, **kw)
    cfg = CkptConfig(warm_start=ref, warm_start_optimizer=carry)
    step, progress = Checkpointer(cfg, paths, tr, max_steps=3).restore(Progress())
    return tr, step, progress


@pytest.mark.parametrize("as_resolved", [False, True], ids=["checkpoint-dir", "resolved-weights-dir"])
def test_optimizer_state_carried_over_bitwise(
    source: RunPaths, tiny_model_dir: Path, tmp_path: Path, as_resolved: bool
) -> None:
    # The roles see the reference resolved to <run>/weights/step_N: it must find the same checkpoint.
    ref = str(source.weights_dir(2) if as_resolved else source.checkpoint_dir(2))
    tr, step, progress = _restore(tiny_model_dir, tmp_path, ref, carry=True)
    assert (step, progress) == (0, Progress())
    saved = load_file(str(source.trainer_ckpt_dir(2) / "rank_0.optim.safetensors"))
    params = [p for g in tr.optimizer.param_groups for p in g["params"]]
    assert len(saved) == 3 * len(params)  # every parameter: exp_avg, exp_avg_sq, step
    for i, p in enumerate(params):
        st = tr.optimizer.state[p]
        for name in ("exp_avg", "exp_avg_sq"):
            want = saved[f"{i}.{name}"]
            assert st[name].dtype == want.dtype and torch.equal(st[name], want), (i, name)
            assert st[name].abs().sum() > 0
        assert float(st["step"]) == 2.0  # bias correction continues from A's two updates
    # This run's own lr and a fresh scheduler: warm-up from its step 0, not A's position.
    assert tr.scheduler.last_epoch == 0
    assert [g["initial_lr"] for g in tr.optimizer.param_groups] == [5e-4] * len(tr.optimizer.param_groups)
    before = {i: tr.optimizer.state[p]["exp_avg"].clone() for i, p in enumerate(params)}
    _train_step(tr, 3)
    assert all(float(tr.optimizer.state[p]["step"]) == 3.0 for p in params)
    assert any(not torch.equal(tr.optimizer.state[p]["exp_avg"], before[i]) for i, p in enumerate(params))
    assert tr.scheduler.last_epoch == 1


def test_without_the_flag_the_optimizer_is_fresh(
    source: RunPaths, tiny_model_dir: Path, tmp_path: Path
) -> None:
    tr, step, _ = _restore(tiny_model_dir, tmp_path, str(source.checkpoint_dir(2)), carry=False)
    assert step == 0 and len(tr.optimizer.state) == 0
    _train_step(tr, 3)
    p = tr.optimizer.param_groups[0]["params"][0]
    assert float(tr.optimizer.state[p]["step"]) == 1.0


def test_a_different_adapter_shape_is_refused_when_loading(
    source: RunPaths, tiny_model_dir: Path, tmp_path: Path
) -> None:
    lora = LoraParams(rank=4, target_modules=("q_proj", "v_proj"))
    with pytest.raises(
        ck.CheckpointError, match=r"^ckpt\.warm_start_optimizer: .*same model and adapter shape"
    ):
        _restore(tiny_model_dir, tmp_path, str(source.checkpoint_dir(2)), carry=True, lora=lora)


def _load(tmp: Path, model_dir: Path, *flags: str):
    from hpcrl.launch.checks import load

    cfg = tmp / "cfg.toml"
    cfg.write_text(rl_toml(1, model=str(model_dir)))
    return load([str(cfg), "--output-dir", str(tmp / "o"), *flags], require_envs=False)


def test_config_refusals_name_the_field(source: RunPaths, tiny_model_dir: Path, tmp_path: Path) -> None:
    ok = _load(
        tmp_path,
        tiny_model_dir,
        "--ckpt.warm-start",
        str(source.checkpoint_dir(2)),
        "--ckpt.warm-start-optimizer",
    )
    assert ok.config.ckpt.warm_start_optimizer and ok.config.ckpt.warm_start == str(source.weights_dir(2))
    cases = [
        ([], "needs ckpt.warm_start"),
        (["--ckpt.warm-start", str(tiny_model_dir)], "is a bare weights dir without optimizer state"),
    ]
    for flags, expected in cases:
        with pytest.raises(ConfigError) as e:
            _load(tmp_path, tiny_model_dir, *flags, "--ckpt.warm-start-optimizer")
        assert e.value.path == "ckpt.warm_start_optimizer" and expected in str(e.value), str(e.value)
        assert "\n" not in str(e.value)


def test_config_refuses_another_adapter_shape(source: RunPaths, tiny_model_dir: Path, tmp_path: Path) -> None:
    """With the source run's resolved config at hand, full vs LoRA (or another rank) is refused at load."""
    run = tmp_path / "a_copy"
    shutil.copytree(source.root, run)
    paths = RunPaths(run)
    paths.resolved_config.write_text(
        f'[model]\nname = "{tiny_model_dir}"\n[model.lora]\nrank = 8\ntarget_modules = ["q_proj"]\n'
    )
    ref = str(paths.checkpoint_dir(2))
    with pytest.raises(
        ConfigError, match="trained LoRA rank 8 on \\['q_proj'\\], this run trains full fine-tuning"
    ):
        _load(tmp_path, tiny_model_dir, "--ckpt.warm-start", ref, "--ckpt.warm-start-optimizer")
    same = ["--model.lora", "--model.lora.rank", "8", "--model.lora.target-modules", '["q_proj"]']
    loaded = _load(tmp_path, tiny_model_dir, "--ckpt.warm-start", ref, "--ckpt.warm-start-optimizer", *same)
    assert loaded.config.ckpt.warm_start_optimizer


def test_hosted_shape_asks_with_a_native_ckpt_table(
    source: RunPaths, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Hosted configs have no key for it: `checkpoint_id` plus a native `[ckpt]` table."""
    from hpcrl.launch.checks import load

    cfg = tmp_path / "hosted.toml"
    cfg.write_text(
        f'model = "{tiny_model_dir}"\nmax_steps = 1\nbatch_size = 16\nrollouts_per_example = 4\n'
        f'checkpoint_id = "{source.checkpoint_dir(2)}"\n[[env]]\nid = "reverse-text"\n'
        "[ckpt]\nwarm_start_optimizer = true\n"
    )
    ck_cfg = load([str(cfg), "--output-dir", str(tmp_path / "o")], require_envs=False).config.ckpt
    assert ck_cfg.warm_start == str(source.weights_dir(2)) and ck_cfg.warm_start_optimizer
