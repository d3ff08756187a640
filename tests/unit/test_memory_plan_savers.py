"""The memory plan with prime-rl's memory savers (trainer.model.ac with freq / selective targets,
ac_offloading, fused_lm_head_token_chunk_size, optim_cpu_offload / full_offload), against numbers
worked out by hand (Qwen3-8B on 8 ranks, 4096 tokens, bf16 compute: the activation model's
per-token-per-layer count A = 4 x 4096 + 6 x (4096 + 2 x 1024) + 4 x 12288 = 102,400 elements)."""

from __future__ import annotations

import pytest

from hpcrl.launch import memory_plan as mp
from hpcrl.launch.placement import slurm_placement
from hpcrl.models.arch import KNOWN, from_config
from tests.unit.test_memory_plan import cfg_of, items

GIB = 1024**3
Q8B = from_config(KNOWN["Qwen/Qwen3-8B"], "test")
A, T, L, H = 102_400, 4096, 36, 4096


def test_checkpointing_every_freq_th_layer():
    full = items(Q8B, ac=True)["activations"] * GIB
    assert full == pytest.approx(T * (L * H + A) * 2)
    # freq 2: layers 0, 2, ..., 34 (18) keep their input, the other 18 keep A, one layer recomputed
    assert items(Q8B, ac=True, ac_freq=2)["activations"] * GIB == pytest.approx(T * (18 * H + 19 * A) * 2)
    # freq 5: 8 checkpointed (0, 5, ..., 35), 28 whole
    assert items(Q8B, ac=True, ac_freq=5)["activations"] * GIB == pytest.approx(T * (8 * H + 29 * A) * 2)
    # offloaded: every layer's keep is on the host, whatever freq
    assert items(Q8B, ac=True, ac_freq=3, offload=True)["activations"] * GIB == pytest.approx(T * A * 2)


def test_selective_targets():
    # mlp drops its 4 x 12288 per token and layer, attn_proj one q + 2 kv copy (4096 + 2 x 1024), norm nothing
    mlp = items(Q8B, ac=True, ac_targets=("mlp",))["activations"] * GIB
    assert mlp == pytest.approx(T * L * (A - 4 * 12288) * 2)
    both = items(Q8B, ac=True, ac_targets=("norm", "attn_proj", "mlp"), ac_freq=2)["activations"] * GIB
    assert both == pytest.approx(T * (L * A - 18 * (4 * 12288 + 6144)) * 2)
    assert items(Q8B, ac=True, ac_targets=("norm",))["activations"] == items(Q8B)["activations"]


def test_optimizer_state_on_the_host():
    on = items(Q8B, optimizer_on_host=True)
    assert on["optimizer"] == 0.0 and on["parameters"] == items(Q8B)["parameters"]
    assert items(Q8B, optimizer="muon")["optimizer"] == items(Q8B)["optimizer"]  # upper bound: 2 states
    assert items(Q8B, optimizer="sign_sgd")["optimizer"] == 0.0


def test_prime_rl_keys_reach_the_plan():
    def plan(*flags):
        cfg = cfg_of("--seq-len", "4096", *flags)
        return {i.name: i for i in mp.plan_for(cfg, slurm_placement(cfg)).trainer}

    base = plan()
    ac = plan("--trainer.model.ac.freq", "2")
    assert ac["activations"].gib * GIB == pytest.approx(T * (18 * H + 19 * A) * 2)
    assert "checkpointing on (every 2)" in ac["activations"].note
    off = plan("--trainer.model.ac-offloading.max-inflight-activations", "2")  # turns [ac] on too
    assert (
        off["activations"].gib * GIB == pytest.approx(T * A * 2)
        and "offloaded to the host" in off["activations"].note
    )
    sel = plan("--trainer.model.ac.mode", "selective", "--trainer.model.ac.targets", '["mlp"]')
    assert sel["activations"].gib * GIB == pytest.approx(T * L * (A - 4 * 12288) * 2)
    chunk = plan("--trainer.model.fused-lm-head-token-chunk-size", "1024")
    assert chunk["logits"].gib * GIB == pytest.approx(1024 * 151_936 * (2 + 4))
    full = plan("--trainer.model.fused-lm-head-token-chunk-size", "disabled")
    assert (
        full["logits"].gib * GIB == pytest.approx(T * 151_936 * (2 + 12)) and "(full" in full["logits"].note
    )
    assert base["logits"].gib < full["logits"].gib  # the default chunks (256 positions)
    for flags in (["--trainer.model.optim-cpu-offload"], ["--trainer.model.full-offload"]):
        opt = plan(*flags)["optimizer"]
        assert opt.gib == 0.0 and "in host memory between steps" in opt.note
    assert base["optimizer"].gib > 7
