"""Router replay on a VL MoE (hpcrl.models.vlm_moe): the routes that hpcrl.trainer.packing passes as
``routed_experts`` (transformers' forward would swallow them) reach every swapped block through the
model's forward pre-hook, per MoE layer in hpcrl's order, for packed text and for the one-sample
image micro-batches (forward_multimodal) alike, and an activation-checkpoint recompute replays them."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.unit.test_vlm_moe import _qwen3_5_moe, _qwen3_vl_moe


def _swapped(make):
    from hpcrl.models.vlm_moe import swap_moe_blocks

    torch.manual_seed(0)
    model = make().float()
    for name, p in model.named_parameters():
        if ".mlp." in name:
            torch.nn.init.normal_(p, std=0.1)
    assert swap_moe_blocks(model) == 2
    return model


def _routes(tokens: int, layers: int = 2, k: int = 2, experts: int = 4) -> torch.Tensor:
    """[1, tokens, layers * k]: k distinct experts a token and layer; the last token routes freely."""
    g = torch.Generator().manual_seed(1)
    r = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens * layers)])
    r = r.reshape(1, tokens, layers * k)
    r[0, -1] = -1
    return r


@pytest.mark.parametrize("make", [_qwen3_vl_moe, _qwen3_5_moe])
def test_routes_reach_every_block(make):
    model = _swapped(make)
    moes = [layer.mlp for layer in model.model.language_model.layers]
    ids = torch.randint(0, 128, (1, 12))
    free = model(input_ids=ids).logits
    routes = _routes(12)
    for m in moes:
        m.stats.load = None
    out = model(input_ids=ids, routed_experts=routes).logits
    for j, m in enumerate(moes):
        assert m.stats.replay_slots == 11 * 2  # every token but the free one
        r = routes[0, :, 2 * j : 2 * j + 2]
        want = torch.bincount(r[r >= 0], minlength=4)
        assert m.stats.load.sum() == 24 and bool((m.stats.load >= want).all())
    assert not torch.equal(out, free)
    # the replayed forward equals giving each block its routes by hand
    ref = copy.deepcopy(model)
    for j, m in enumerate(layer.mlp for layer in ref.model.language_model.layers):
        m.replay_routes = None
        fwd = m.forward
        m.forward = lambda x, replay=None, fwd=fwd, j=j: fwd(
            x, routes[0, :, 2 * j : 2 * j + 2].reshape(-1, 2)
        )
    torch.testing.assert_close(out, ref(input_ids=ids).logits, rtol=0, atol=0)
    # a forward without routes routes freely again
    torch.testing.assert_close(model(input_ids=ids).logits, free, rtol=0, atol=0)


def test_image_micro_batches_and_ac_recompute_replay_the_routes():
    from hpcrl.config.sections.model import ActivationCheckpointConfig
    from hpcrl.trainer.memory_savers import apply_ac
    from hpcrl.trainer.sft_vlm import VisionBatch, forward_multimodal

    model = _swapped(_qwen3_vl_moe)
    apply_ac(model, ActivationCheckpointConfig(mode="full"))
    moes = [layer.mlp for layer in model.model.language_model.layers]
    t = 12
    routes = _routes(t)[0]
    mb = VisionBatch(
        input_ids=torch.randint(0, 128, (t,)),
        position_ids=torch.arange(t),
        seq_lens=torch.tensor([t]),
        loss_mask=torch.ones(t, dtype=torch.bool),
        routed_experts=routes,
    )
    out = forward_multimodal(model, mb)
    assert all(m.stats.replay_slots == 11 * 2 for m in moes)
    out.logprobs.sum().backward()  # the recompute replays: same saved tensors, or checkpoint raises
    free = forward_multimodal(model, VisionBatch(**{**mb.__dict__, "routed_experts": None}))
    assert not torch.equal(out.logprobs.detach(), free.logprobs.detach())


def test_image_samples_split_from_the_packed_batch_keep_their_routes():
    """hpcrl.trainer.rl_vlm.split_vision builds each image sample's VisionBatch from
    PackedBatch.select_samples: its routes are that sample's rows of the packed batch's."""
    from hpcrl.trainer.packing import PackedBatch

    routes = _routes(10)[0]
    packed = PackedBatch(
        input_ids=torch.arange(10), position_ids=torch.arange(10), seq_lens=torch.tensor([4, 6]),
        loss_mask=torch.zeros(10, dtype=torch.bool), routed_experts=routes,
    )  # fmt: skip
    assert torch.equal(packed.select_samples([1]).routed_experts, routes[4:])
