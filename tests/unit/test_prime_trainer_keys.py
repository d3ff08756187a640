"""prime-rl's trainer model and trainer keys (issue 50), as its configs of today write them: each
parses into the hpcrl field that does the same thing (aliases listed once), acts in the trainer
(checkpoint resume without optimizer / scheduler state, the token export, the distributed
timeout), and says in one note what it does where its kernel or device is not there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpcrl import checkpoint as ck
from hpcrl.config import ConfigError
from hpcrl.config.prime_model import device_notes
from hpcrl.config.schema import CkptConfig, SFTConfig, TrainerModelConfig
from hpcrl.launch.checks import load
from hpcrl.models.spec import load_model
from hpcrl.models.tokenizer import load_tokenizer
from hpcrl.paths import RunPaths
from hpcrl.trainer import optim, precision
from hpcrl.trainer.checkpointer import Checkpointer
from hpcrl.trainer.core import Progress
from hpcrl.trainer.parallel import DistEnv
from hpcrl.trainer.setup import Training

# the trainer part of prime-rl's examples/advanced/glm-4.5-air/swe.toml, on the tiny model
PRIME = """
seq_len = 2048
max_steps = 4
[model]
name = "hpcrl/tiny-qwen3"
[trainer]
dist_timeout_seconds = 1800
enable_router_replay = true
enable_token_export = true
[trainer.model]
impl = "custom"
cp_style = "ulysses"
optim_cpu_offload = false
full_offload = true
fused_lm_head_token_chunk_size = 1024
[trainer.model.ac]
[trainer.model.ac_offloading]
max_inflight_activations = 1
[trainer.model.compile]
[trainer.model.quantization]
type = "fp8"
[trainer.ckpt]
skip_optimizer = true
[[orchestrator.train.env]]
id = "reverse-text"
"""
BASE = ["--model.name", "hpcrl/tiny-qwen3", "--orchestrator.train.env", '[{id = "reverse-text"}]']


def _load(tmp_path: Path, text: str, *flags: str):
    f = tmp_path / "cfg.toml"
    f.write_text(text)
    return load([str(f), *flags]).config


def test_prime_trainer_keys_parse(tmp_path: Path) -> None:
    cfg = _load(tmp_path, PRIME)
    m = cfg.trainer.model
    assert m.ac is not None and (m.ac.mode, m.ac.freq, m.ac.targets) == ("full", 1, ["norm"])
    assert m.ac_offloading.max_inflight_activations == 1 and m.ac_offloading.pin_memory
    assert m.compile is not None and not m.compile.fullgraph and m.compile.backend == "inductor"
    assert m.full_offload is not None and not m.optim_cpu_offload
    assert m.quantization.type == "fp8"
    assert (m.cp_mode, m.logprobs_chunk_tokens, m.router_replay) == ("ulysses", 1024, True)
    assert m.activation_checkpointing and m.activation_offload  # the shorthands follow the tables
    assert cfg.trainer.dist_timeout_seconds == 1800 and cfg.trainer.enable_token_export
    assert cfg.ckpt.skip_optimizer and not cfg.ckpt.skip_scheduler
    assert cfg.seq_len == 2048


def test_prime_values_and_flags(tmp_path: Path) -> None:
    cfg = _load(
        tmp_path,
        '[model]\nname = "hpcrl/tiny-qwen3"\ncompile = "None"\nac = "None"\n'
        'fused_lm_head_token_chunk_size = "disabled"\n[[orchestrator.train.env]]\nid = "reverse-text"\n',
    )
    m = cfg.trainer.model
    assert m.compile is None and m.ac is None and m.logprobs_chunk_tokens == 0
    m = load(
        [
            *BASE,
            "--trainer.model.cp-style",
            "ulysses",
            "--trainer.model.fused-lm-head-token-chunk-size",
            "disabled",
            "--trainer.model.seq-len",
            "512",
            "--trainer.enable-router-replay",
            "false",
            "--trainer.model.ac.freq",
            "2",
        ]
    ).config
    tm = m.trainer.model
    assert (tm.cp_mode, tm.logprobs_chunk_tokens, tm.router_replay, m.seq_len) == ("ulysses", 0, False, 512)
    assert tm.ac.freq == 2 and tm.activation_checkpointing
    with pytest.raises(ConfigError, match="cp_style: conflicts with trainer.model.cp_mode = 'ring'"):
        _load(tmp_path, PRIME.replace('cp_style = "ulysses"', 'cp_style = "ulysses"\ncp_mode = "ring"'))
    with pytest.raises(ConfigError, match="optim_cpu_offload and full_offload exclude each other"):
        load([*BASE, "--trainer.model.optim-cpu-offload", "--trainer.model.full-offload"])
    with pytest.raises(ConfigError, match="selective activation checkpointing needs at least one target"):
        load([*BASE, "--trainer.model.ac.mode", "selective", "--trainer.model.ac.targets", "[]"])


def test_sft_reads_the_same_keys(tmp_path: Path) -> None:
    from hpcrl.config.loader import load as load_any

    f = tmp_path / "sft.toml"
    f.write_text(
        'dist_timeout_seconds = 900\n[model]\nname = "hpcrl/tiny-qwen3"\ncompile = "None"\n'
        'cp_style = "ring"\nfused_lm_head_token_chunk_size = 64\noptim_cpu_offload = false\nfull_offload = true\n'
        '[model.ac]\nmode = "selective"\ntargets = ["norm", "attn_proj", "norm"]\n'
        '[ckpt]\nskip_optimizer = true\nskip_scheduler = true\n[data]\nname = "data.jsonl"\n'
    )
    cfg = load_any([str(f)], root=SFTConfig).config
    assert cfg.dist_timeout_seconds == 900 and cfg.model.compile is None
    assert (cfg.model.cp_mode, cfg.model.logprobs_chunk_tokens) == ("ring", 64)
    assert cfg.model.ac.targets == ["norm", "attn_proj"] and cfg.model.full_offload is not None
    assert cfg.ckpt.skip_optimizer and cfg.ckpt.skip_scheduler


def test_notes_say_what_happens_here(tmp_path: Path) -> None:
    m = _load(tmp_path, PRIME).trainer.model
    cpu = device_notes(m, "trainer.model", on_gpu=False)
    gpu = device_notes(m, "trainer.model", on_gpu=True)
    assert len(cpu) == 3 and len(gpu) == 2
    assert cpu[0].startswith(
        "trainer.model.quantization = fp8: FP8 training matmuls are GPU kernels hpcrl does not"
    )
    assert "trainer.model.full_offload: the optimizer state is kept in host memory" in gpu[1]
    assert "ac_offloading: the trainer computes on CPU" in cpu[2]
    assert device_notes(TrainerModelConfig(), "model", on_gpu=False) == []
    assert device_notes(TrainerModelConfig(optim_cpu_offload=True), "model", on_gpu=False)[0].startswith(
        "model.optim_cpu_offload: the trainer computes on CPU"
    )


def test_dist_timeout_reaches_the_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcrl.trainer import parallel, setup

    seen = {}

    class Joined(Exception):
        pass

    def init(device, timeout_s):
        seen["timeout"] = timeout_s
        raise Joined

    monkeypatch.setattr(parallel, "init_distributed", init)
    with pytest.raises(Joined):
        setup.build_training(TrainerModelConfig(), optim_cfg=None, total_steps=1, seed=0, dist_timeout_s=1800)
    assert seen["timeout"] == 1800


# ------------------------------------------------------------------------ skip_optimizer / scheduler
def _training(model_dir: Path) -> Training:
    torch.manual_seed(0)
    model = load_model(model_dir)
    opt = optim.build_optimizer(model, "adamw", lr=1e-2)

    def make(steps: int):
        return optim.build_scheduler(opt, "linear", warmup_steps=2, total_steps=steps)

    return Training(
        model,
        load_tokenizer(model_dir),
        opt,
        make(6),
        torch.device("cpu"),
        str(model_dir),
        DistEnv(0, 1, 0, "127.0.0.1", 0),
        precision.of_model(TrainerModelConfig(), on_gpu=False),
        make_scheduler=make,
    )


def _train(tr: Training, steps: int) -> None:
    ids = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(5))
    for _ in range(steps):
        tr.model(input_ids=ids, use_cache=False).logits.float().logsumexp(-1).mean().backward()
        tr.optimizer.step()
        tr.optimizer.zero_grad()
        tr.scheduler.step()


@pytest.mark.parametrize("skip", ["optimizer", "scheduler", "both", "neither"])
def test_resume_skips_optimizer_or_scheduler(tiny_model_dir: Path, tmp_path: Path, skip: str) -> None:
    paths = RunPaths(tmp_path / "run")
    paths.make_dirs()
    tr = _training(tiny_model_dir)
    _train(tr, 3)
    c = Checkpointer(CkptConfig(interval=1, hf_weights="never"), paths, tr, 6, parts=("trainer",))
    c.save(3, Progress(step=3))
    c.close()
    assert ck.verify(paths, 3) is None
    cfg = CkptConfig(
        resume_step=3,
        skip_optimizer=skip in ("optimizer", "both"),
        skip_scheduler=skip in ("scheduler", "both"),
    )
    fresh = _training(tiny_model_dir)
    step, progress = Checkpointer(cfg, paths, fresh, 6, parts=("trainer",)).restore(Progress())
    assert (step, progress.step) == (3, 3)
    for (n, a), b in zip(tr.model.named_parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b), n  # the weights always come back
    if cfg.skip_optimizer:
        assert not fresh.optimizer.state  # moments and step counters start afresh at the next step
    else:
        a = [s["exp_avg"] for s in tr.optimizer.state.values()]
        b = [s["exp_avg"] for s in fresh.optimizer.state.values()]
        assert len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    if cfg.skip_scheduler:  # a fresh schedule over the 3 remaining steps: warmup again
        assert fresh.scheduler.last_epoch == 0 and fresh.scheduler is not tr.scheduler
        first = _training(tiny_model_dir).optimizer.param_groups[0]["lr"]  # a new run's step-1 lr
        assert fresh.optimizer.param_groups[0]["lr"] == first == pytest.approx(0.005)
    else:
        assert fresh.scheduler.last_epoch == 3
        assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(tr.optimizer.param_groups[0]["lr"])
    _train(fresh, 1)  # and the resumed run trains


# ------------------------------------------------------------------------------------ token export
def test_token_export_writes_aligned_columns(tiny_model_dir: Path, tmp_path: Path) -> None:
    from hpcrl.trainer.loss import LossParams
    from hpcrl.trainer.packing import PackedBatch, forward_packed
    from hpcrl.trainer.token_export import TokenExporter

    paths = RunPaths(tmp_path / "run")
    model = load_model(tiny_model_dir)
    lens = [7, 5, 9]
    n = sum(lens)
    mask = torch.ones(n, dtype=torch.bool)
    mask[[0, 12]] = False  # a sample's first token is predicted by nothing
    mask[7:12] = False  # the second sample has no loss tokens: not exported
    mb = PackedBatch(
        input_ids=torch.randint(0, 200, (n,), generator=torch.Generator().manual_seed(3)),
        position_ids=torch.cat([torch.arange(k) for k in lens]),
        seq_lens=torch.tensor(lens),
        loss_mask=mask,
        advantages=torch.linspace(-1, 1, n),
        inference_logprobs=torch.full((n,), -3.0),
        env_index=torch.tensor([0, 0, 1]),
    )
    fwd = forward_packed(model, mb, wanted=mb.loss_mask)
    ex = TokenExporter(
        paths, 0, LossParams(type="default", mode="rl", eps_low=0.2, eps_high=0.28), ["a", "b"]
    )
    assert ex.export(5, 0, mb, fwd.logprobs, fwd.entropy) == 2
    ex.finish(5)
    f = paths.token_export_file(5, 0)
    rows = [json.loads(line) for line in f.read_text().splitlines()]
    assert (f.parent / "STABLE").is_file() and [r["micro_sequence_idx"] for r in rows] == [0, 2]
    assert [r["env_name"] for r in rows] == ["a", "b"]
    r = rows[1]
    assert {len(v) for v in r.values() if isinstance(v, list)} == {9}
    assert r["token_ids"] == mb.input_ids[12:].tolist() and r["position_ids"] == list(range(9))
    lp = fwd.logprobs[12:].tolist()
    assert r["trainer_logprobs"][0] is None and r["is_masked"][0] is None  # off the loss mask: null
    for t in range(1, 9):
        assert r["trainer_logprobs"][t] == pytest.approx(lp[t])
        assert r["log_importance_ratio"][t] == pytest.approx(lp[t] + 3.0, abs=1e-6)
        kl = r["mismatch_kl"][t]
        assert kl == pytest.approx(torch.expm1(torch.tensor(lp[t] + 3.0)).item() - (lp[t] + 3.0), rel=1e-5)
        adv = r["advantages"][t]
        ratio = r["importance_ratio"][t]
        assert r["is_masked"][t] == ((adv > 0 and ratio > 1.28) or (adv < 0 and ratio < 0.8))
