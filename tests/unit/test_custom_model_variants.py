"""hpcrl's own Qwen3 / Qwen3-MoE (impl = custom) against transformers on many small random configs, fp32.

Every case builds its model locally (transformers' ``from_config`` under a fixed seed, saved as
safetensors; no hub, no tokenizer: ``load_model`` reads none). Served configs must give logits within
1e-4 absolute of transformers' (SDPA), export exactly the saved tensors under the saved names, and give
the same gradients (every parameter, experts mapped through the state-dict adapter) of the summed
next-token log-probabilities, within 1e-4 absolute + 1e-4 relative. Configs the custom model cannot
serve must be refused by ``impl = "custom"`` with a one-line ``trainer.model.impl`` error, and
``impl = "auto"`` must then fall back to transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

ATOL = 1e-4
GRAD_TOL = 1e-4

DENSE: dict[str, Any] = dict(
    vocab_size=200,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
MOE: dict[str, Any] = dict(
    DENSE,
    hidden_size=32,
    head_dim=8,
    intermediate_size=64,
    moe_intermediate_size=24,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1e4}

# name -> (model type, overrides of DENSE / MOE, sequence length)
SERVED: dict[str, tuple[str, dict[str, Any], int]] = {
    "dense-tied": ("qwen3", dict(tie_word_embeddings=True), 24),
    "dense-gqa-untied-3-layers": ("qwen3", dict(num_hidden_layers=3), 24),
    "dense-head_dim-not-hidden/heads": ("qwen3", dict(hidden_size=32, head_dim=16), 24),
    "dense-mqa": ("qwen3", dict(num_key_value_heads=1), 24),
    "dense-mha": ("qwen3", dict(num_key_value_heads=4), 24),
    "dense-rope_theta-1e6": ("qwen3", dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}), 24),
    "moe-sparse-step-2": ("qwen3_moe", dict(num_hidden_layers=4, decoder_sparse_step=2), 24),
    "moe-mlp_only_layers-0": ("qwen3_moe", dict(num_hidden_layers=3, mlp_only_layers=[0]), 24),
    "moe-norm_topk_prob-false": ("qwen3_moe", dict(norm_topk_prob=False), 24),
    "moe-top1": ("qwen3_moe", dict(num_experts_per_tok=1), 24),
    "moe-topk-all-6": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=6, norm_topk_prob=False), 24),
    "moe-6-experts": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=2), 24),
    "moe-tied": ("qwen3_moe", dict(tie_word_embeddings=True, mlp_only_layers=[1]), 24),
    "moe-head_dim-not-hidden/heads": ("qwen3_moe", dict(head_dim=16, num_key_value_heads=1), 24),
    # RoPE scaling: 48 positions, past original_max_position_embeddings = 32
    "rope-linear": (
        "qwen3",
        dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}),
        48,
    ),
    "rope-yarn": ("qwen3", dict(rope_parameters=YARN, max_position_embeddings=128), 48),
    "rope-yarn-legacy-rope_scaling": ("qwen3", dict(legacy=True, max_position_embeddings=128), 48),
    "rope-llama3": (
        "qwen3",
        dict(
            rope_parameters={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 5e5,
            }
        ),
        48,
    ),
    "moe-rope-yarn": ("qwen3_moe", dict(rope_parameters=YARN, max_position_embeddings=128), 48),
}

# name -> (model type, overrides, sequence length, a word the refusal names)
REFUSED: dict[str, tuple[str, dict[str, Any], int, str]] = {
    "rope-dynamic": ("qwen3", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), 48, "dynamic"),
    "rope-longrope": (
        "qwen3",
        dict(
            rope_parameters={
                "rope_type": "longrope",
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 32,
                "factor": 4.0,
            },
            max_position_embeddings=128,
        ),
        48,
        "longrope",
    ),
    "attention_bias": ("qwen3", dict(attention_bias=True), 24, "bias"),
    "dense-sliding-window": (
        "qwen3",
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),
        24,
        "sliding",
    ),
    "moe-sliding-window": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8), 24, "sliding"),
}


def _build(root: Path, name: str, model_type: str, overrides: dict[str, Any]) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    kw = {**(DENSE if model_type == "qwen3" else MOE), **overrides}
    legacy = kw.pop("legacy", False)
    if legacy:  # what older Qwen3 checkpoints write: rope_scaling with "type", rope_theta at the top
        kw["rope_scaling"] = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
        kw["rope_theta"] = 1e4
    cfg = (Qwen3Config if model_type == "qwen3" else Qwen3MoeConfig)(**kw)
    torch.manual_seed(0)
    path = root / name.replace("/", "_")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path, safe_serialization=True)
    if legacy:
        raw = json.loads((path / "config.json").read_text())
        rope = raw.pop("rope_parameters")
        raw["rope_theta"] = rope.pop("rope_theta")
        raw["rope_scaling"] = {
            "type": rope["rope_type"],
            **{k: v for k, v in rope.items() if k != "rope_type"},
        }
        (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("variants")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            model_type, overrides = (SERVED.get(name) or REFUSED[name])[:2]
            built[name] = _build(root, name, model_type, overrides)
        return built[name]

    return get


def _hf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


def _ids(vocab: int, seq: int) -> torch.Tensor:
    return torch.randint(3, vocab, (2, seq), generator=torch.Generator().manual_seed(0))


def _next_token_logprob(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None]).sum()


@pytest.mark.parametrize("name", list(SERVED))
def test_logits_and_export_match_transformers(name: str, model_dir) -> None:
    from safetensors import safe_open

    from hpcrl.models.qwen3.model import Qwen3ForTraining
    from hpcrl.models.spec import load_model
    from hpcrl.trainer.model import hf_named_tensors

    path = model_dir(name)
    hf = _hf(path)
    custom = load_model(path, impl="custom").eval()
    assert isinstance(custom, Qwen3ForTraining)
    ids = _ids(hf.config.vocab_size, SERVED[name][2])
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = custom(input_ids=ids).logits
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err < ATOL, f"{name}: max |custom - hf| = {err:.3g}"

    named = dict(hf_named_tensors(custom))
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())  # noqa: SIM118
        assert set(named) == saved, (sorted(set(named) - saved)[:4], sorted(saved - set(named))[:4])
        for k in saved:
            assert torch.equal(named[k], f.get_tensor(k)), k


@pytest.mark.parametrize("name", list(SERVED))
def test_gradients_match_transformers(name: str, model_dir) -> None:
    from hpcrl.models.qwen3.state_dict_adapter import from_hf
    from hpcrl.models.spec import load_model

    path = model_dir(name)
    hf = _hf(path)
    custom = load_model(path, impl="custom").eval()
    ids = _ids(hf.config.vocab_size, SERVED[name][2])
    _next_token_logprob(hf(input_ids=ids).logits, ids).backward()
    _next_token_logprob(custom(input_ids=ids).logits, ids).backward()
    want = from_hf({n: p.grad for n, p in hf.named_parameters() if p.grad is not None})
    got = {n: p.grad for n, p in custom.named_parameters() if p.grad is not None}
    for key in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
        assert key in got, key
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:4]
    for n in got:
        assert got[n].shape == want[n].shape, (n, got[n].shape, want[n].shape)
        assert torch.allclose(got[n], want[n], atol=GRAD_TOL, rtol=GRAD_TOL), (
            n,
            (got[n] - want[n]).abs().max().item(),
        )


@pytest.mark.parametrize("name", list(REFUSED))
def test_unservable_configs_are_refused_and_auto_falls_back(name: str, model_dir) -> None:
    from hpcrl.models.qwen3.model import Qwen3ForTraining
    from hpcrl.models.spec import load_model

    path = model_dir(name)
    with pytest.raises(ValueError) as info:
        load_model(path, impl="custom")
    msg = str(info.value)
    assert msg.startswith("trainer.model.impl"), msg
    assert "\n" not in msg and REFUSED[name][3] in msg.lower(), msg

    model = load_model(path, impl="auto").eval()
    assert not isinstance(model, Qwen3ForTraining)
    hf = _hf(path)
    ids = _ids(hf.config.vocab_size, REFUSED[name][2])
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, hf(input_ids=ids).logits
    assert (got - want).abs().max().item() < ATOL
