"""models.tokenizer.load_tokenizer: the direct path gives what AutoTokenizer gives, without torch."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.models.tokenizer import direct_class_name, load_tokenizer

MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "reverse: héllo 123"},
    {"role": "assistant", "content": "<think>x</think>321 olléh"},
    {"role": "user", "content": "again <|im_end|>"},
]


@pytest.fixture(scope="module")
def qwen3_template_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's files with the qwen3-template tokenizer (Qwen3's added tokens and template)."""
    from hpcrl.models.tiny import build_tokenizer

    d = tmp_path_factory.mktemp("qwen3_template")
    shutil.copy(tiny_model_dir / "config.json", d / "config.json")
    build_tokenizer("qwen3").save_pretrained(str(d))
    return d


def _variant(src: Path, dst: Path, tok_edit=None, cfg_edit=None) -> Path:
    shutil.copytree(src, dst)
    for name, edit in (("tokenizer_config.json", tok_edit), ("config.json", cfg_edit)):
        if edit is not None:
            data = json.loads((dst / name).read_text())
            edit(data)
            (dst / name).write_text(json.dumps(data))
    return dst


def _same(a, b) -> None:
    assert type(a) is type(b)
    assert a.get_vocab() == b.get_vocab()
    assert a.all_special_tokens == b.all_special_tokens
    assert (a.eos_token_id, a.pad_token_id, a.bos_token_id) == (
        b.eos_token_id,
        b.pad_token_id,
        b.bos_token_id,
    )
    assert (a.padding_side, a.model_max_length) == (b.padding_side, b.model_max_length)
    for gen in (False, True):
        ra = a.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        rb = b.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert ra == rb
        assert a(ra).input_ids == b(rb).input_ids
    ids = a("héllo 123 <|im_end|> <think>").input_ids
    assert a.decode(ids) == b.decode(ids)


@pytest.mark.parametrize("which", ["chatml", "qwen3"])
def test_direct_load_equals_auto_tokenizer(
    tiny_model_dir: Path, qwen3_template_dir: Path, which: str
) -> None:
    from transformers import AutoTokenizer

    path = tiny_model_dir if which == "chatml" else qwen3_template_dir
    assert direct_class_name(path) == "TokenizersBackend"
    _same(load_tokenizer(path), AutoTokenizer.from_pretrained(str(path)))


def test_the_moe_model_type_loads_directly(tiny_model_dir: Path, tmp_path: Path) -> None:
    d = _variant(tiny_model_dir, tmp_path / "moe", cfg_edit=lambda c: c.update(model_type="qwen3_moe"))
    assert direct_class_name(d) == "TokenizersBackend"


@pytest.mark.parametrize(
    "case",
    [
        "remote_code",
        "auto_map",
        "config_auto_map",
        "named_class",
        "other_model_type",
        "no_tokenizer_json",
        "no_config",
        "hub_id",
    ],
)
def test_everything_else_goes_through_auto_tokenizer(tiny_model_dir: Path, tmp_path: Path, case: str) -> None:
    src = tiny_model_dir
    if case == "remote_code":
        assert direct_class_name(src, trust_remote_code=True) is None
        return
    if case == "hub_id":
        assert direct_class_name("Qwen/Qwen3-0.6B") is None
        return
    edits = {
        "auto_map": dict(tok_edit=lambda t: t.update(auto_map={"AutoTokenizer": ["x.T", None]})),
        "config_auto_map": dict(cfg_edit=lambda c: c.update(auto_map={"AutoConfig": "x.C"})),
        "named_class": dict(tok_edit=lambda t: t.update(tokenizer_class="Qwen2Tokenizer")),
        "other_model_type": dict(cfg_edit=lambda c: c.update(model_type="llama")),
    }
    d = _variant(src, tmp_path / case, **edits.get(case, {}))
    if case == "no_tokenizer_json":
        (d / "tokenizer.json").unlink()
    if case == "no_config":
        (d / "config.json").unlink()
    assert direct_class_name(d) is None


def test_a_process_that_loads_the_tiny_tokenizer_imports_no_torch(tiny_model_dir: Path) -> None:
    code = (
        "import sys; from hpcrl.models.tokenizer import load_tokenizer; "
        f"t = load_tokenizer({str(tiny_model_dir)!r}); "
        "print(type(t).__name__, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["TokenizersBackend", "False"]
