"""Row layout and shared prefixes (hpcrl/trainer/layout.py): hand-checked indices and masks, and the
forward with shared prefixes equal to every sample run alone (values and gradients)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from hpcrl.models.spec import load_model
from hpcrl.trainer.layout import (
    choose_width,
    common_prefix,
    key_cost_of,
    row_layout,
    rows_needed,
    shared_prefixes,
    unit_slots,
    units_of,
)
from hpcrl.trainer.packing import PackedBatch, forward_packed, micro_batches, with_shared_prefixes

VOCAB = 64


def flat(samples: list[list[int]]) -> tuple[np.ndarray, np.ndarray, list[int]]:
    ids = np.array([t for s in samples for t in s], dtype=np.int64)
    pos = np.concatenate([np.arange(len(s)) for s in samples]).astype(np.int64)
    return ids, pos, [len(s) for s in samples]


def test_shared_prefixes_by_hand():
    ids, pos, lens = flat([[1, 2, 3, 9], [1, 2, 3, 8, 7], [1, 2, 4], [5, 6], [5, 6, 1]])
    assert common_prefix(ids, pos, (0, 4), (4, 5)) == 3
    # key_cost 0: a unit of n slots costs n^2 (attention only).
    # s1 joins s0: 3 + 1 + 2 = 6 slots, 36 <= 16 + 25. s2 would cut the prefix to 2: 8 slots,
    # 64 > 36 + 9: new unit. s3 shares nothing with s2. s4 joins s3: 2 + 0 + 1 = 3 slots, 9 <= 4 + 9.
    assert shared_prefixes(ids, pos, lens, 100, key_cost=0).tolist() == [0, 3, 0, 0, 2]
    # when linear layers dominate (key_cost 512), s2 is worth sharing even 2 tokens: 8 * 520 <= 6 * 518 + 3 * 515
    assert shared_prefixes(ids, pos, lens, 100, key_cost=512).tolist() == [0, 2, 2, 0, 2]
    # the unit budget stops a unit from growing: s0 + s1 would take 6 slots
    assert shared_prefixes(ids, pos, lens, 5, key_cost=0).tolist() == [0, 0, 0, 0, 2]
    # a token only counts as shared if its position id agrees too (s1 then shares 1 token: not worth it)
    pos2 = pos.copy()
    pos2[5] = 7
    assert shared_prefixes(ids, pos2, lens, 100, key_cost=0).tolist() == [0, 0, 0, 0, 2]
    assert units_of([0, 3, 0, 0, 2], 5) == [(0, 2, 3), (2, 3, 0), (3, 5, 2)]
    assert units_of(None, 2) == [(0, 1, 0), (1, 2, 0)]
    assert unit_slots([(0, 2, 3), (2, 3, 0), (3, 5, 2)], lens) == [6, 3, 3]


def test_key_cost_and_a_common_system_prompt():
    from transformers import Qwen3Config

    # tiny-qwen3: d 128, 4 heads x 32, 2 kv heads, ffn 256: per token 128*(128+2*64) + 128*128 + 3*128*256
    # = 147,456 multiply-adds per layer; one query-key pair 2 * 128 = 256: 576 keys' worth
    cfg = Qwen3Config(
        hidden_size=128, num_attention_heads=4, head_dim=32, num_key_value_heads=2, intermediate_size=256
    )
    assert key_cost_of(cfg) == 576
    # 16 prompts = a 46-token system prompt + 10 tokens of their own, 8 completions of 16 tokens each:
    # one unit per prompt (56 shared + 8 x 16 = 184 slots), not units chained by the system prompt
    rng = np.random.default_rng(0)
    system = rng.integers(0, 400, 46).tolist()
    samples = []
    for _ in range(16):
        prompt = system + rng.integers(0, 400, 10).tolist()
        samples += [prompt + rng.integers(0, 400, 16).tolist() for _ in range(8)]
    ids, pos, lens = flat(samples)
    pl = shared_prefixes(ids, pos, lens, 4096, key_cost_of(cfg))
    units = units_of(pl.tolist(), len(lens))
    assert len(units) == 16 and {p for _, _, p in units} == {56}
    assert unit_slots(units, lens) == [184] * 16


def test_row_layout_without_sharing_by_hand():
    # width = longest sample (3); first-fit decreasing: s0 (3) | s3 (3) | s2 (2) + s1 (1): no padding
    lay = row_layout(torch.tensor([3, 1, 2, 3]))
    assert (lay.rows, lay.width) == (3, 3)
    assert lay.index.tolist() == [0, 1, 2, 8, 6, 7, 3, 4, 5]
    assert lay.unit.tolist() == [0, 0, 0, 3, 3, 3, 2, 2, 1]
    # [2, 3, 1]: s1 | s0 + s2
    lay = row_layout(torch.tensor([2, 3, 1]))
    assert (lay.rows, lay.width) == (2, 3) and lay.index.tolist() == [3, 4, 0, 1, 2, 5]
    assert lay.member.tolist() == [-1] * 6  # no shared prefix: every slot acts as its unit's prefix
    assert lay.grid(torch.tensor([5, 6, 7, 8, 9, 4]), fill=0).tolist() == [[7, 8, 9], [5, 6, 4]]
    m = lay.mask()[:, 0].int().tolist()
    assert m[0] == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert m[1] == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]  # s2 does not see s0
    # [3, 2]: s0 | s1 + one padding slot (slot s holds unit -1 - s), which sees only itself
    lay = row_layout(torch.tensor([3, 2]))
    assert lay.unit.tolist() == [0, 0, 0, 1, 1, -6]
    assert lay.mask()[1, 0].int().tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    f = lay.mask(torch.float32)[1, 0]
    assert f[1, 0] == 0 and f[2, 0] == torch.finfo(torch.float32).min


def test_row_layout_with_a_shared_prefix_by_hand():
    # s0 = [a b c d], s1 = [a b c e f] share 3 tokens: one unit [a b c | d | e f] of 6 slots; s2 = [g h]
    lay = row_layout(torch.tensor([4, 5, 2]), torch.tensor([0, 3, 0]))
    assert (lay.rows, lay.width) == (2, 6)
    assert lay.index.tolist() == [0, 1, 2, 3, 0, 1, 2, 4, 5, 6, 7]
    assert lay.member.tolist() == [-1, -1, -1, 0, 1, 1] + [-1] * 6
    assert lay.unit.tolist() == [0] * 6 + [1, 1, -9, -10, -11, -12]
    m = lay.mask()[0, 0].int().tolist()
    assert m[3] == [1, 1, 1, 1, 0, 0]  # d sees the prefix and itself
    assert m[4] == [1, 1, 1, 0, 1, 0]  # e sees the prefix, not its sibling d
    assert m[5] == [1, 1, 1, 0, 1, 1]
    assert lay.mask()[1, 0].int().tolist()[3] == [0, 0, 0, 1, 0, 0]  # padding sees only itself
    ids = torch.tensor([10, 11, 12, 13, 10, 11, 12, 14, 15, 16, 17])
    assert lay.grid(ids).tolist() == [[10, 11, 12, 13, 14, 15], [16, 17, 0, 0, 0, 0]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    cfg = Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    )
    out = tmp_path_factory.mktemp("qwen3_layout")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return out


def group_batch(prompt_len: int, completions: list[int], groups: int, seed: int = 0) -> PackedBatch:
    """``groups`` prompts, each followed by completions of the given lengths (a GRPO batch)."""
    g = torch.Generator().manual_seed(seed)
    ids, lens, mask, temps = [], [], [], []
    for k in range(groups):
        prompt = torch.randint(0, VOCAB, (prompt_len,), generator=g)
        for n in completions:
            ids.append(torch.cat([prompt, torch.randint(0, VOCAB, (n,), generator=g)]))
            lens.append(prompt_len + n)
            mask.append(
                torch.cat([torch.zeros(prompt_len, dtype=torch.bool), torch.ones(n, dtype=torch.bool)])
            )
            temps.append(0.7 if k % 2 else 1.0)
    t = sum(lens)
    return PackedBatch(
        input_ids=torch.cat(ids),
        position_ids=torch.cat([torch.arange(n) for n in lens]),
        seq_lens=torch.tensor(lens),
        loss_mask=torch.cat(mask),
        advantages=torch.randn(t, generator=g),
        inference_logprobs=-torch.rand(t, generator=g),
        temperatures=torch.tensor(temps),
    )


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("wanted_is_loss_mask", [True, False])
def test_shared_prefix_forward_equals_samples_alone(model_dir: Path, attn: str, wanted_is_loss_mask: bool):
    batch = group_batch(prompt_len=9, completions=[3, 5, 1, 4], groups=3)
    shared = with_shared_prefixes(batch, 4096)
    assert shared.prefix_lens is not None and int((shared.prefix_lens > 0).sum()) >= 9
    results = []
    for b in (batch, shared):
        model = load_model(model_dir, attn_impl=attn)
        lp, ent, slots = [], [], 0
        for mb in micro_batches(b, 40):  # several micro-batches, units kept whole
            out = forward_packed(model, mb, wanted=mb.loss_mask if wanted_is_loss_mask else None)
            (out.logprobs * mb.advantages).sum().backward()
            lp.append(out.logprobs.detach())
            ent.append(out.entropy)
            slots += out.slots
        results.append((torch.cat(lp), torch.cat(ent), [p.grad for p in model.parameters()], slots))
    (lp0, ent0, g0, slots0), (lp1, ent1, g1, slots1) = results
    torch.testing.assert_close(lp1, lp0, atol=2e-6, rtol=0)
    torch.testing.assert_close(ent1, ent0, atol=2e-6, rtol=0)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)  # float sums in another order
    assert slots1 < slots0 * 0.75  # the three 9-token prompts are computed once, not 4 times


def test_micro_batches_keep_units_whole():
    batch = with_shared_prefixes(group_batch(prompt_len=9, completions=[3, 5, 1, 4], groups=3), 4096)
    # each unit takes 9 + 13 = 22 slots; a 30-slot budget holds one unit per micro-batch
    mbs = micro_batches(batch, 30)
    assert [mb.seq_lens.tolist() for mb in mbs] == [[12, 14, 10, 13]] * 3
    assert all(mb.prefix_lens.tolist() == [0, 9, 9, 9] for mb in mbs)


def test_row_micro_batches_pack_the_whole_batch_once(model_dir: Path):
    from hpcrl.trainer.packing import row_micro_batches

    lens = [5, 1, 7, 3]
    b = PackedBatch(
        input_ids=torch.arange(16),
        position_ids=torch.cat([torch.arange(n) for n in lens]),
        seq_lens=torch.tensor(lens),
        loss_mask=torch.zeros(16, dtype=torch.bool),
        temperatures=torch.tensor([1.0, 0.7, 1.3, 0.9]),
    )
    # width 7, first-fit decreasing over the whole batch: s2 | s0 + s1 | s3; 14 tokens = 2 rows each
    mbs = row_micro_batches(b, 14)
    assert [mb.seq_lens.tolist() for mb in mbs] == [[7, 5, 1], [3]]
    assert torch.equal(mbs[0].input_ids[:7], b.input_ids[6:13]) and torch.equal(
        mbs[1].input_ids, b.input_ids[13:]
    )
    assert torch.equal(mbs[0].input_ids[7:], b.input_ids[:6])
    assert mbs[0].temperatures.tolist() == pytest.approx([1.3, 1.0, 0.7]) and mbs[0].position_ids[
        :7
    ].tolist() == list(range(7))
    # Same loss gradient as the in-order micro-batches, with and without shared prefixes.
    batch = group_batch(prompt_len=9, completions=[3, 5, 1, 4], groups=3)
    grads = []
    for mbs in (
        micro_batches(batch, 40),
        row_micro_batches(batch, 40),
        row_micro_batches(with_shared_prefixes(batch, 40), 40),
    ):
        model = load_model(model_dir)
        tokens = 0
        for mb in mbs:
            out = forward_packed(model, mb, wanted=mb.loss_mask)
            (out.logprobs * mb.advantages).sum().backward()
            tokens += mb.num_tokens
        assert tokens == batch.num_tokens
        grads.append([p.grad for p in model.parameters()])
    for other in grads[1:]:
        for a, g in zip(grads[0], other):
            torch.testing.assert_close(g, a, atol=1e-5, rtol=1e-4)


def test_choose_width_by_hand():
    # [3, 2]: width 3 pads 1 of 6 slots (17 %); width 5 holds both in one row, no padding, and is
    # cheaper too: 5 * (512 + 5) < 6 * (512 + 3).
    assert choose_width([3, 2], key_cost=512) == 5
    assert row_layout(torch.tensor([3, 2]), key_cost=512).width == 5
    assert row_layout(torch.tensor([3, 2])).width == 3  # no cost model: rows as wide as the longest
    # Equal units (a GRPO batch's groups) fill rows of the longest exactly: nothing to gain.
    assert choose_width([184] * 16, key_cost=576) == 184
    # 100 + 60 + 60 + 40 = 260 slots, first-fit decreasing:
    #   width 100: 100 | 60+40 | 60          3 rows = 300 slots, 13.3 % padding, cost 300 * 612
    #   width 150: 100+40 | 60+60            2 rows = 300 slots, 13.3 %,         cost 300 * 662
    #   width 125 / 175 / 200 / 250: 30.8 / 25.7 / 35 / 48 %
    #   width 260 (3x and 4x, capped at all units in one row): 0 %,      cost 260 * 772
    sizes = [100, 60, 60, 40]
    assert [rows_needed(sizes, w) for w in (100, 150, 260)] == [3, 2, 1]
    assert choose_width(sizes, key_cost=512, max_padding=0.14) == 100  # cheapest within the cap
    assert choose_width(sizes, key_cost=512, max_padding=0.07) == 260  # only one row is within
    # Capped at 160, nothing pads <= 7 %: the least padding wins, ties to the narrower (100, not 150).
    assert choose_width(sizes, key_cost=512, max_padding=0.07, max_width=160) == 100
    assert choose_width(sizes, key_cost=512, max_padding=0.07, max_width=50) == 100  # never below the longest
    assert choose_width([3, 2], key_cost=512, max_padding=0.0) == 5


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("share", [False, True])
def test_chosen_row_width_equals_samples_alone(model_dir: Path, attn: str, share: bool):
    """Rows wider than the longest unit (chosen to cut padding) give the same logprobs and gradients
    as every sample run on its own."""
    from hpcrl.trainer.packing import row_micro_batches

    g = torch.Generator().manual_seed(3)
    batch = group_batch(prompt_len=6, completions=[2, 9, 4, 13, 7, 1], groups=4, seed=5)
    if share:
        batch = with_shared_prefixes(batch, 64)
    lens = [int(n) for n in torch.randint(5, 21, (10,), generator=g)]
    t = sum(lens)
    loose = PackedBatch(
        input_ids=torch.randint(0, VOCAB, (t,), generator=g),
        position_ids=torch.cat([torch.arange(n) for n in lens]),
        seq_lens=torch.tensor(lens),
        loss_mask=torch.arange(t) % 3 != 0,
        advantages=torch.randn(t, generator=g),
    )
    for b in (batch, loose):
        b.loss_mask[torch.cumsum(b.seq_lens, 0) - b.seq_lens] = False
        alone = micro_batches(replace_prefix(b), 1)  # one sample per micro-batch: no layout at all
        model = load_model(model_dir, attn_impl=attn)
        key_cost = key_cost_of(model.config)
        packed = row_micro_batches(b, 64, key_cost)
        units = units_of(None if b.prefix_lens is None else b.prefix_lens.tolist(), b.num_samples)
        longest = max(unit_slots(units, b.seq_lens.tolist()))
        assert packed[0].row_width is not None and packed[0].row_width >= longest
        if b is loose:  # 5-20 tokens: rows of the longest would pad; the new path is exercised
            assert packed[0].row_width > longest
        results = []
        for mbs in (alone, packed):
            model = load_model(model_dir, attn_impl=attn)
            lp, slots, pad = {}, 0, 0
            for mb in mbs:
                out = forward_packed(model, mb, wanted=mb.loss_mask)
                (out.logprobs * mb.advantages).sum().backward()
                slots, pad = slots + out.slots, pad + out.padding
                # key each sample's logprobs by its token ids (samples are reordered by packing)
                for ids, v in zip(
                    mb.input_ids.split(mb.seq_lens.tolist()),
                    out.logprobs.detach().split(mb.seq_lens.tolist()),
                ):
                    lp.setdefault(tuple(ids.tolist()), []).append(v)
            results.append((lp, [p.grad for p in model.parameters()], slots, pad))
        (lp0, g0, _, _), (lp1, g1, slots1, pad1) = results
        assert lp0.keys() == lp1.keys()
        for k in lp0:
            torch.testing.assert_close(torch.stack(lp1[k]), torch.stack(lp0[k]), atol=2e-6, rtol=0)
        for a, c in zip(g0, g1):
            torch.testing.assert_close(c, a, atol=1e-5, rtol=1e-4)
        assert pad1 <= 0.25 * slots1


def replace_prefix(b: PackedBatch) -> PackedBatch:
    from dataclasses import replace

    return replace(b, prefix_lens=None)
