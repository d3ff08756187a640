"""The embedded engine's emulated FP8 (hpcrl.inference.fp8): block scales checked by hand, round-trip
error bounds, edge blocks smaller than 128, and the served-bytes arithmetic of the memory plan."""

from __future__ import annotations

import pytest
import torch

from hpcrl.inference.fp8 import (
    E4M3_MAX,
    MIN_AMAX,
    block_scales,
    fake_quant,
    fake_quant_params,
    quantized_names,
    weight_bytes_per_param,
)


def _130():
    # 130 x 130: blocks (0,0) 128x128, (0,1) 128x2, (1,0) 2x128, (1,1) 2x2 (edge blocks)
    w = torch.zeros(130, 130)
    w[5, 7] = -448.0  # block (0,0): amax 448 -> scale 1
    w[3, 1] = 1.1  # ... rounds to the nearest E4M3 value at scale 1: 1.125 (step 0.125 in [1, 2))
    w[0, 129] = 2.0  # block (0,1): amax 2 -> scale 2 / 448
    w[129, 129] = 896.0  # block (1,1): amax 896 -> scale 2
    # block (1,0) stays zero: amax floored at 1e-4 -> scale 1e-4 / 448
    return w


def test_block_scales_by_hand():
    s = block_scales(_130(), (128, 128))
    assert s.shape == (2, 2)
    assert s[0, 0].item() == pytest.approx(1.0)
    assert s[0, 1].item() == pytest.approx(2.0 / 448)
    assert s[1, 0].item() == pytest.approx(MIN_AMAX / E4M3_MAX)
    assert s[1, 1].item() == pytest.approx(2.0)


def test_pow2_scales_round_up():
    # amax 2: 2 / 448 = 2^-7.807 -> 2^-7; amax 448 -> exactly 2^0; amax 896 -> 2^1
    s = block_scales(_130(), (128, 128), pow2=True)
    assert s[0, 1].item() == 2.0**-7
    assert s[0, 0].item() == 1.0 and s[1, 1].item() == 2.0


def test_round_trip_by_hand():
    q = fake_quant(_130())
    assert q[5, 7].item() == -448.0  # the block's amax maps onto E4M3's max: exact
    assert q[3, 1].item() == 1.125  # 1.1 -> 1.125
    assert q[0, 129].item() == pytest.approx(2.0)  # amax of its (edge) block: exact up to fp32
    assert q[129, 129].item() == 896.0
    assert int((q[128:, :128] != 0).sum()) == 0  # zeros stay zero


@pytest.mark.parametrize("shape", [(128, 128), (200, 70), (3, 300), (2, 5, 130)])
def test_round_trip_error_bound(shape):
    torch.manual_seed(0)
    w = torch.randn(*shape) * torch.logspace(-3, 1, shape[-1])  # columns of very different magnitude
    q = fake_quant(w)
    assert q.shape == w.shape and q.dtype == w.dtype
    full = block_scales(w, (128, 128))
    full = full.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., : shape[-2], : shape[-1]]
    # E4M3: 3 mantissa bits -> |err| <= 2^-4 |x| for normals; subnormal steps are 2^-9 * scale
    assert bool(((q - w).abs() <= w.abs() * 2**-4 + full * 2**-9 + 1e-12).all())
    assert (q - w).abs().max() > 0  # it really quantizes
    assert torch.equal(fake_quant(q), q)  # idempotent: FP8 values re-quantize onto themselves


def test_bf16_weights_keep_their_dtype():
    w = torch.randn(64, 256, dtype=torch.bfloat16)
    q = fake_quant(w)
    assert q.dtype == torch.bfloat16
    rel = ((q.float() - w.float()).norm() / w.float().norm()).item()
    assert 0 < rel < 0.05  # ~2-3 % relative error, as FP8 E4M3 gives


def test_params_in_place_skip_embeddings_norms_and_aliases():
    torch.manual_seed(0)
    lin = torch.randn(4, 8)
    params = {
        "model.embed_tokens.weight": torch.randn(10, 8),
        "lm_head.weight": torch.randn(10, 8),
        "model.layers.0.mlp.up_proj.weight": lin,
        "alias.weight": lin,  # a tied alias: quantized once
        "model.layers.0.input_layernorm.weight": torch.randn(8),
        "model.layers.0.mlp.gate.weight": torch.randn(4, 8),  # an MoE router: kept
    }
    before = {k: v.clone() for k, v in params.items()}
    assert quantized_names(params) == ["model.layers.0.mlp.up_proj.weight", "alias.weight"]
    assert fake_quant_params(params, "fp8_per_block") == 1
    assert torch.equal(params["model.embed_tokens.weight"], before["model.embed_tokens.weight"])
    assert torch.equal(params["lm_head.weight"], before["lm_head.weight"])
    assert not torch.equal(lin, before["alias.weight"])
    assert torch.equal(lin, fake_quant(before["alias.weight"]))
    assert fake_quant_params(params, None) == 0 and fake_quant_params(params, "awq") == 0


def test_served_bytes_per_param():
    assert weight_bytes_per_param("fp8_per_block", 2) == pytest.approx(1 + 4 / 16384)
    assert weight_bytes_per_param("mxfp8", 2) == pytest.approx(1 + 1 / 32)
    assert weight_bytes_per_param("fp8", 2) == 1.0
    assert weight_bytes_per_param(None, 2) == 2 and weight_bytes_per_param("awq", 2) == 2


def test_memory_plan_counts_fp8_weights():
    from hpcrl.launch import memory_plan as mp
    from hpcrl.launch.memory_units import GIB
    from hpcrl.models.arch import KNOWN, from_config

    q8b = from_config(KNOWN["Qwen/Qwen3-8B"], "test")
    kw = {"tp": 1, "dtype": "bfloat16", "limit_gib": 80, "utilization": 0.9}
    bf16, t_bf16 = mp.inference_items(q8b, **kw)
    fp8, t_fp8 = mp.inference_items(q8b, quantization="fp8_per_block", **kw)
    w = {i.name: i for i in fp8}["weights"]
    # embeddings + untied LM head (1,244,663,808) stay bf16; the 36 layers' 6,946,071,552 parameters
    # take 1 byte + one fp32 scale per 128 x 128 block: 2,489,327,616 + 6,946,071,552 x (1 + 4 / 16384)
    assert w.gib * GIB == pytest.approx(1_244_663_808 * 2 + 6_946_071_552 * (1 + 4 / 16384))  # 8.79 GiB
    assert w.dtype == "fp8" and "fp8_per_block" in w.note
    assert {i.name: i for i in bf16}["weights"].gib == pytest.approx(15.255, abs=0.01)
    assert t_fp8 > t_bf16  # the 6.47 GiB saved go to the KV cache
