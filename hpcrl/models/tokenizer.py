"""Loading a model's tokenizer: one function for every role.

`transformers.AutoTokenizer` imports torch whatever the tokenizer (its config classes pull in the
rope utilities): 2.4 s of CPU in a process that never runs a model, such as the orchestrator. Where
the answer of AutoTokenizer is known without its config machinery, the tokenizer class is loaded
directly: a local directory whose tokenizer_config.json names the generic tokenizers backend, with
no remote code, and a model type for which AutoTokenizer keeps the class the files name (the Qwen3
families, the built-in tiny models among them; tests/unit/test_tokenizer_load.py checks that both
ways give the same tokenizer). Everything else goes through AutoTokenizer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# Model types whose tokenizer AutoTokenizer loads as the class tokenizer_config.json names.
_DIRECT_MODEL_TYPES = frozenset({"qwen3", "qwen3_moe"})
_DIRECT_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def direct_class_name(path: str | os.PathLike[str], trust_remote_code: bool = False) -> str | None:
    """The tokenizer class to load `path` with, without AutoTokenizer; None: ask AutoTokenizer."""
    root = Path(path)
    if trust_remote_code or not (root / "tokenizer.json").is_file():
        return None
    try:
        tok_cfg = json.loads((root / "tokenizer_config.json").read_text())
        model_cfg = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(tok_cfg, dict) or not isinstance(model_cfg, dict) or "auto_map" in tok_cfg:
        return None
    if tok_cfg.get("tokenizer_class") not in _DIRECT_CLASSES:
        return None
    if model_cfg.get("model_type") not in _DIRECT_MODEL_TYPES or "auto_map" in model_cfg:
        return None
    return "TokenizersBackend"


def load_tokenizer(path: str | os.PathLike[str], trust_remote_code: bool = False) -> Any:
    """The tokenizer of the model at `path` (a local directory or a Hub id in the local cache)."""
    if direct_class_name(path, trust_remote_code) is not None:
        from transformers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
