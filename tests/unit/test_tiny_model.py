"""The tiny model kit: loads with transformers, renders chat, is deterministic, caches safely."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")


def test_round_trip_gives_identical_logits(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.3e6 <= n_params <= 0.5e6
    assert model.config.tie_word_embeddings
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        before = model(ids).logits
    model.save_pretrained(tmp_path / "copy")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "copy").eval()
    with torch.no_grad():
        after = again(ids).logits
    assert torch.equal(before, after)


def test_chat_template_renders_and_tokenizes(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert 300 <= len(tok) <= 512
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Reverse: hello 12+3"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 3}}}],
        },
        {"role": "tool", "content": "15"},
    ]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "add"' in text
    assert '<tool_call>{"name": "add", "arguments": {"a": 12, "b": 3}}</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n15<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    no_gen = tok.apply_chat_template(msgs[:2], tokenize=False)
    assert not no_gen.endswith("<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # byte-level BPE is lossless
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 5
    # Digits are single tokens: arithmetic tokenizes uniformly.
    assert tok.convert_ids_to_tokens(tok("12345", add_special_tokens=False)["input_ids"]) == list("12345")
    # Prefix property needed for multi-turn stitching.
    assert text.startswith(tok.apply_chat_template(msgs[:2], tools=tools, tokenize=False))


def test_build_is_deterministic(tiny_model_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from hpcrl.models.tiny import build_tiny_model

    other = build_tiny_model(tmp_path / "again", preset="tiny", seed=0)
    a, b = load_file(tiny_model_dir / "model.safetensors"), load_file(other / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tiny_model_dir / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()
    different = load_file(build_tiny_model(tmp_path / "seed1", seed=1) / "model.safetensors")
    assert not all(torch.equal(a[k], different[k]) for k in a)


def _resolve(name: str) -> str:
    from hpcrl.models.resolve import resolve_model

    return resolve_model(name)


def test_resolve_model(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpcrl.models.resolve import resolve_model

    assert resolve_model(str(tiny_model_dir)) == str(tiny_model_dir)
    # Hub ids go through the Hugging Face cache: tests/unit/test_hub.py
    monkeypatch.setenv("HPCRL_CACHE", str(tmp_path / "cache"))
    # Two processes racing on a cold cache: both get the same, complete directory.
    with mp.get_context("spawn").Pool(2) as pool:
        paths = pool.map(_resolve, ["hpcrl/tiny-qwen3"] * 2)
    assert paths[0] == paths[1] == str(tmp_path / "cache" / "models" / "hpcrl" / "tiny-qwen3")
    assert (Path(paths[0]) / "model.safetensors").exists()
    assert not [p for p in Path(paths[0]).parent.iterdir() if p.name.startswith(".build-")]


def test_cli_builds_small_preset(tmp_path: Path) -> None:
    from hpcrl.models.tiny import main

    assert main([str(tmp_path / "small"), "--preset", "small", "--seed", "3"]) == 0
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tmp_path / "small")
    assert cfg.hidden_size == 256 and cfg.num_hidden_layers == 4
