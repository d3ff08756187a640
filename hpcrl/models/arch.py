"""Architecture numbers of a causal LM (what the --dry-run memory plan needs), without loading it.

    arch = find_arch("Qwen/Qwen3-30B-A3B")   # Arch or None; never downloads
    arch.params, arch.expert_params, arch.source

Where the numbers come from, first match wins: a local model directory's config.json; a built-in
tiny model (its cached build, else its preset); the Hugging Face cache's config.json of a Hub id
(read only: `hpcrl.models.hub.cached_snapshot`); the small table below of known Hub architectures (then
`source` says so). Pure except for reading those files.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.errors import ConfigError


@dataclass(frozen=True)
class Arch:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (unused by MoE layers)
    vocab: int
    tied: bool = False  # lm_head shares the embedding
    num_experts: int = 0  # 0: dense
    top_k: int = 0
    moe_intermediate: int = 0
    sparse_layers: int | None = (
        None  # MoE layers of an MoE model (None: all; decoder_sparse_step / mlp_only_layers)
    )
    vision_params: int = 0  # a vision-language model's vision encoder (vision_param_count); 0: none
    source: str = ""

    @property
    def moe(self) -> bool:
        return self.num_experts > 0 and self.sparse_layers != 0

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def embed_params(self) -> int:
        """Input embedding + lm_head (once when tied) + final norm: FSDP's root unit."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def attn_params(self) -> int:
        """One layer's attention: q, k, v, o projections, q/k norms, the two RMSNorms."""
        proj = self.hidden * (self.q_dim + 2 * self.kv_dim) + self.q_dim * self.hidden
        return proj + 2 * self.head_dim + 2 * self.hidden

    @property
    def expert_layer_params(self) -> int:
        """One MoE layer's experts (gate, up, down of each)."""
        return self.num_experts * 3 * self.hidden * self.moe_intermediate

    @property
    def dense_layer_params(self) -> int:
        """One layer's parameters that are not experts (attention, router or dense MLP)."""
        mlp = self.hidden * self.num_experts if self.moe else 3 * self.hidden * self.intermediate
        return self.attn_params + mlp

    @property
    def moe_layers(self) -> int:
        if not self.moe:
            return 0
        return self.layers if self.sparse_layers is None else self.sparse_layers

    @property
    def expert_params(self) -> int:
        return self.moe_layers * self.expert_layer_params

    @property
    def params(self) -> int:
        if not self.moe:
            return self.embed_params + self.layers * self.dense_layer_params
        dense_mlp = 3 * self.hidden * self.intermediate  # a dense layer of an MoE model (no router)
        routed = self.dense_layer_params + self.expert_layer_params
        return (
            self.embed_params
            + self.moe_layers * routed
            + (self.layers - self.moe_layers) * (self.attn_params + dense_mlp)
        )

    @property
    def mlp_width(self) -> int:
        """MLP activations per token: the dense width, or top_k routed copies of an expert's width."""
        return self.top_k * self.moe_intermediate if self.moe else self.intermediate


def from_config(c: dict[str, Any], source: str) -> Arch:
    """An Arch from a Hugging Face config.json dict (Qwen3 / Qwen3-MoE / Llama-style names; a
    multimodal config's `text_config` is used when present, its `vision_config` counted apart)."""
    vision = vision_param_count(c)
    c = c.get("text_config") or c
    hidden, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
    experts = int(c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0)
    return Arch(
        hidden=hidden,
        layers=int(c["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        intermediate=int(c.get("intermediate_size") or 0),
        vocab=int(c["vocab_size"]),
        tied=bool(c.get("tie_word_embeddings", False)),
        num_experts=experts,
        top_k=int(c.get("num_experts_per_tok") or 0) if experts else 0,
        moe_intermediate=int(c.get("moe_intermediate_size") or c.get("intermediate_size") or 0)
        if experts
        else 0,
        sparse_layers=_sparse_layers(c) if experts else None,
        vision_params=vision,
        source=source,
    )


# The vision encoders of the families hpcrl.trainer.sft_vlm trains: model_type -> (family, the
# vision config's defaults in transformers, for keys a config.json leaves out).
_QWEN3_VISION = dict(
    depth=27, hidden_size=1152, intermediate_size=4304, in_channels=3, patch_size=16,
    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584, num_position_embeddings=2304,
)  # fmt: skip
_VISION: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_vl": ("qwen2_vl", dict(
        depth=32, embed_dim=1280, hidden_size=3584, mlp_ratio=4, in_channels=3, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2,
    )),
    "qwen2_5_vl": ("qwen2_5_vl", dict(
        depth=32, hidden_size=3584, intermediate_size=3420, in_channels=3, patch_size=14,
        spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=3584,
    )),
    "qwen3_vl": ("qwen3_vl", {**_QWEN3_VISION, "deepstack_visual_indexes": [8, 16, 24]}),
    "qwen3_vl_moe": ("qwen3_vl", {**_QWEN3_VISION, "deepstack_visual_indexes": [8, 16, 24]}),
    "qwen3_5": ("qwen3_5", _QWEN3_VISION),
    "qwen3_5_moe": ("qwen3_5", _QWEN3_VISION),
}  # fmt: skip


def vision_config(c: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """(family, the vision config with transformers' defaults filled in) of a config.json dict; None
    without a vision_config of a family in _VISION."""
    v = c.get("vision_config")
    if not isinstance(v, dict):
        return None
    mt = str(c.get("model_type") or "")
    if mt not in _VISION:  # a bare vision config, or an old Qwen2-VL one that names its parent
        mt = str(v.get("model_type") or "").removesuffix("_vision")
    if mt not in _VISION:
        return None
    family, defaults = _VISION[mt]
    g = {**defaults, **{k: x for k, x in v.items() if x is not None}}
    g.setdefault("in_channels", g.get("in_chans", 3))
    return family, g


def vision_param_count(c: dict[str, Any]) -> int:
    """Parameters of a config.json's vision encoder (`vision_config`; 0 without one, or for a family
    not in _VISION), module by module as transformers builds it (tests/unit/test_arch_vision.py
    checks it against the models themselves):
      patch embed   C x t x p x p x E (a Conv3d; + E bias in Qwen3-VL / Qwen3.5)
      positions     num_position_embeddings x E (Qwen3-VL / Qwen3.5's learned grid)
      a block       2 norms + qkv (3E^2 + 3E) + proj (E^2 + E) + the MLP: fc1, fc2 (2EI + I + E), or
                    Qwen2.5-VL's gate, up, down (3EI + 2I + E); LayerNorm 2E, Qwen2.5-VL's RMSNorm E
      merger        a norm over E + fc1 (H^2 + H) + fc2 (H x O + O), H = E x merge^2, O its output width;
                    Qwen3-VL adds one per deepstack index, its norm over H
    E: the vision width (Qwen2-VL: embed_dim; its hidden_size is O), I: the MLP width (Qwen2-VL:
    E x mlp_ratio)."""
    found = vision_config(c)
    if found is None:
        return 0
    family, g = found
    qwen2 = family == "qwen2_vl"
    e = int(g["embed_dim"] if qwen2 else g["hidden_size"])
    out = int(g["hidden_size"] if qwen2 else g["out_hidden_size"])
    inter = int(e * g["mlp_ratio"]) if qwen2 else int(g["intermediate_size"])
    patch = int(g["in_channels"]) * int(g["temporal_patch_size"]) * int(g["patch_size"]) ** 2 * e
    norm = e if family == "qwen2_5_vl" else 2 * e
    mlp = 3 * e * inter + 2 * inter + e if family == "qwen2_5_vl" else 2 * e * inter + inter + e
    block = 2 * norm + 4 * e * e + 4 * e + mlp
    h = e * int(g["spatial_merge_size"]) ** 2
    merger = h * h + h + h * out + out
    total = patch + int(g["depth"]) * block + norm + merger
    if family in ("qwen3_vl", "qwen3_5"):
        total += e + int(g["num_position_embeddings"]) * e  # the patch embed's bias, the position grid
    if family == "qwen3_vl":
        total += len(g.get("deepstack_visual_indexes") or []) * (2 * h + merger)
    return total


def _sparse_layers(c: dict[str, Any]) -> int | None:
    """How many layers are MoE (Qwen-MoE's decoder_sparse_step / mlp_only_layers); None: all of them."""
    step = int(c.get("decoder_sparse_step") or 1)
    dense = set(c.get("mlp_only_layers") or [])
    if step == 1 and not dense:
        return None
    return sum(1 for i in range(int(c["num_hidden_layers"])) if i not in dense and (i + 1) % step == 0)


def _qwen3(hidden, layers, heads, kv, inter, tied=False, experts=0, moe_inter=0) -> dict[str, Any]:
    d = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=128,
        intermediate_size=inter,
        vocab_size=151936,
        tie_word_embeddings=tied,
    )
    if experts:
        d.update(num_experts=experts, num_experts_per_tok=8, moe_intermediate_size=moe_inter)
    return d


# Known Hub architectures (the numbers of their config.json), for ids not in the local cache.
KNOWN: dict[str, dict[str, Any]] = {
    "Qwen/Qwen3-0.6B": _qwen3(1024, 28, 16, 8, 3072, tied=True),
    "Qwen/Qwen3-1.7B": _qwen3(2048, 28, 16, 8, 6144, tied=True),
    "Qwen/Qwen3-4B": _qwen3(2560, 36, 32, 8, 9728, tied=True),
    "Qwen/Qwen3-8B": _qwen3(4096, 36, 32, 8, 12288),
    "Qwen/Qwen3-14B": _qwen3(5120, 40, 40, 8, 17408),
    "Qwen/Qwen3-32B": _qwen3(5120, 64, 64, 8, 25600),
    "Qwen/Qwen3-30B-A3B": _qwen3(2048, 48, 32, 4, 6144, experts=128, moe_inter=768),
    "Qwen/Qwen3-235B-A22B": _qwen3(4096, 94, 64, 4, 12288, experts=128, moe_inter=1536),
}
# Releases that keep their base model's architecture (Qwen3-30B-A3B-Thinking-2507 is Qwen3-30B-A3B).
_VARIANTS = ("-Base", "-Instruct-2507", "-Thinking-2507")


def known(name: str) -> tuple[str, dict[str, Any]] | None:
    """(table key, config numbers) of a Hub id in the table, variants included."""
    repo = name.partition("@")[0]
    for suffix in _VARIANTS:
        if repo.endswith(suffix):
            repo = repo[: -len(suffix)]
            break
    return (repo, KNOWN[repo]) if repo in KNOWN else None


def _json(path: Path) -> dict[str, Any] | None:
    try:
        c = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return c if isinstance(c, dict) else None


def _read(path: Path, source: str) -> Arch | None:
    c = _json(path)
    try:
        return None if c is None else from_config(c, source)
    except (ValueError, KeyError, TypeError):
        return None


def _builtin(name: str) -> Arch | None:
    from hpcrl.models import resolve, tiny
    from hpcrl.models.names import BUILTIN_MODELS

    builtin = BUILTIN_MODELS.get(name)
    if builtin is None:
        return None
    preset = builtin.partition(":")[0]  # "preset:template"
    built = resolve.cache_root() / "models" / name / "config.json"
    if built.exists():
        arch = _read(built, f"config.json of the built {name}")
        if arch is not None:
            return arch
    shape = tiny.MOE_PRESETS[preset] if preset in tiny.MOE_PRESETS else tiny.PRESETS[preset]
    cfg = {"vocab_size": tiny.VOCAB_SIZE, "tie_word_embeddings": True, **shape}
    return from_config(cfg, f"hpcrl preset '{preset}'")


def _cached_config(name: str, cache_dir: str | None) -> Path | None:
    from hpcrl.models.hub import cached_snapshot

    try:
        snapshot = cached_snapshot(name, cache_dir=cache_dir)
    except ConfigError:  # an id the cache cannot even name is simply not cached
        return None
    return None if snapshot is None else Path(snapshot) / "config.json"


def _hf_cache(name: str, cache_dir: str | None) -> Arch | None:
    path = _cached_config(name, cache_dir)
    return None if path is None else _read(path, f"config.json in the HF cache ({name.partition('@')[0]})")


def local_config(
    name: str | None, cache_dir: str | None = None, filename: str = "config.json"
) -> dict[str, Any] | None:
    """The config.json dict (or `filename`'s: preprocessor_config.json) of a model directory or a Hub
    id in the HF cache (None: neither; a built-in tiny model's once built). Never downloads."""
    if not name:
        return None
    if os.path.isdir(name):
        return _json(Path(name) / filename)
    from hpcrl.models import resolve
    from hpcrl.models.names import BUILTIN_MODELS

    if name in BUILTIN_MODELS:
        return _json(resolve.cache_root() / "models" / name / filename)
    path = _cached_config(name, cache_dir)
    return None if path is None else _json(path.with_name(filename))


def find_arch(name: str | None, cache_dir: str | None = None) -> Arch | None:
    """The architecture of model `name`, or None when nothing local or in the table describes it
    (`cache_dir`: the HF cache to read, default the environment's)."""
    if not name:
        return None
    if os.path.isdir(name):
        return _read(Path(name) / "config.json", f"{name}/config.json")
    arch = _builtin(name) or _hf_cache(name, cache_dir)
    if arch is not None:
        return arch
    hit = known(name)
    if hit is None:
        return None
    key, numbers = hit
    return from_config(numbers, f"built-in table ({key}; not in the HF cache)")
