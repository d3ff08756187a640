"""Chunked LM head + log-softmax (hpcrl/models/chunked.py): values, entropy and gradients equal the
unchunked path (fp32, within 1e-6), on raw tensors and through forward_packed on a tiny Qwen3
(shared prefixes and per-sample temperatures included)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hpcrl.models import chunked
from hpcrl.models.chunked import chunk_rows, chunked_token_logprobs
from hpcrl.models.spec import load_model
from hpcrl.trainer.packing import PackedBatch, forward_packed, next_token_logprobs, with_shared_prefixes

VOCAB = 97
TOL = 1e-6


def _unchunked(h, w, y, temp):
    return next_token_logprobs(h @ w.t(), y, temp, entropy=True)


def test_chunk_rows_bounded_in_bytes() -> None:
    # 32 MiB / (4 B x 151,936) = 55.2 rows; a 32k vocabulary fits all 256 (262.1)
    assert chunk_rows(256, 151_936, 32) == 55
    assert chunk_rows(256, 32_000, 32) == 256
    assert chunk_rows(256, 151_936, 0) == 256  # no bound
    assert chunk_rows(0, 151_936, 32) == 0  # chunking off stays off
    assert chunk_rows(256, 10**9, 32) == 1  # at least one row


@pytest.mark.parametrize("chunk", [1, 5, 16, 1000])
@pytest.mark.parametrize("per_row_temp", [False, True])
@pytest.mark.parametrize("exp_rows", [0, 3])
def test_chunked_equals_full_log_softmax(
    chunk: int, per_row_temp: bool, exp_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if exp_rows:  # the exp() sums over a few rows at a time, as at a real vocabulary (6 rows at 151,936)
        monkeypatch.setattr(chunked, "EXP_BYTES", exp_rows * 4 * VOCAB)
    g = torch.Generator().manual_seed(1)
    k, hdim = 37, 12
    # logits of std ~1 (as a trained LM's): the chunk's matmul rounds differently from the whole
    # one's, ~1 ulp of the logit, which the 1e-6 absolute tolerance must cover
    h0 = 0.3 * torch.randn(k, hdim, generator=g)
    w0 = torch.randn(VOCAB, hdim, generator=g).float()
    y = torch.randint(0, VOCAB, (k,), generator=g)
    temp = 0.5 + torch.rand(k, generator=g) if per_row_temp else 0.7
    coef = torch.randn(k, generator=g)  # an arbitrary loss: sum(coef * logp)

    ha, wa = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    lp_a, ent_a = _unchunked(ha, wa, y, temp)
    (coef * lp_a).sum().backward()
    hb, wb = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    lp_b, ent_b = chunked_token_logprobs(hb, wb, y, temp, chunk=chunk, entropy=True)
    (coef * lp_b).sum().backward()

    assert ent_b is not None and not ent_b.requires_grad
    for name, a, b in (
        ("lp", lp_a, lp_b),
        ("ent", ent_a, ent_b),
        ("dh", ha.grad, hb.grad),
        ("dw", wa.grad, wb.grad),
    ):
        # entropy (a metric, ~log V = 4.6 here) and the gradients (sums over the vocabulary, up to ~5
        # here: a 1-row chunk sums them in another order, a few fp32 ulps apart on some CPUs) are
        # compared relative to their size
        err = ((a - b).abs() / (a.abs().clamp(min=1.0) if name != "lp" else 1.0)).max().item()
        assert err <= TOL, (name, err)
    assert wa.grad.abs().max() > 1e-3  # the comparison is not between zeros


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
    out = tmp_path_factory.mktemp("qwen3_chunk")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    return out


def _batch() -> PackedBatch:
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (6,), generator=g).tolist()
    samples = [prompt + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 9, 3)]
    samples.append(torch.randint(0, VOCAB, (11,), generator=g).tolist())
    lens = [len(s) for s in samples]
    seq_lens = torch.tensor(lens)
    mask = torch.zeros(sum(lens), dtype=torch.bool)
    off = 0
    for i, n in enumerate(lens):
        mask[off + (6 if i < 3 else 1) : off + n] = True
        off += n
    return PackedBatch(
        input_ids=torch.tensor([t for s in samples for t in s]),
        position_ids=torch.cat([torch.arange(n) for n in lens]),
        seq_lens=seq_lens,
        loss_mask=mask,
        temperatures=torch.tensor([1.0, 0.7, 1.3, 0.9]),
    )


@pytest.mark.parametrize("share", [False, True])
def test_forward_packed_chunked_equals_unchunked(model_dir: Path, share: bool) -> None:
    mb = _batch()
    if share:
        mb = with_shared_prefixes(mb, 1000)
        assert int(mb.prefix_lens.sum()) > 0
    mb = replace(mb)
    outs = []
    for chunk in (0, 4):
        model = load_model(model_dir)
        fwd = forward_packed(model, mb, wanted=mb.loss_mask, chunk_tokens=chunk)
        coef = torch.linspace(-1, 1, mb.num_tokens)
        (coef * fwd.logprobs).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        outs.append((fwd, grads))
    (a, ga), (b, gb) = outs
    assert (a.logprobs - b.logprobs).abs().max().item() <= TOL
    assert ((a.entropy - b.entropy).abs() / a.entropy.abs().clamp(min=1.0)).max().item() <= TOL  # relative
    worst = max((ga[n] - gb[n]).abs().max().item() for n in ga)
    assert worst <= TOL, worst
    assert ga["model.embed_tokens.weight"].abs().max() > 1e-3


def test_prompt_logprobs_chunked_equals_full(model_dir: Path) -> None:
    from hpcrl.models.chunked import prompt_logprobs

    model = load_model(model_dir)
    ids = torch.randint(0, VOCAB, (1, 23), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        full = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1).gather(1, ids[0, 1:, None])[
            :, 0
        ]
        chunked = prompt_logprobs(model, ids, chunk=4)
    assert chunked.shape == (22,)
    assert (full - chunked).abs().max().item() <= TOL
