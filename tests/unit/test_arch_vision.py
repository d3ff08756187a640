"""hpcrl.models.arch.vision_param_count against transformers: each family's vision model built on the
meta device (no memory, no weights) from a config, its parameters counted, for a few sizes each and
for the vision_config a released checkpoint's config.json carries (keys it leaves out take
transformers' defaults)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hpcrl.models.arch import from_config, vision_param_count  # noqa: E402

# model_type -> (vision config class, vision model class), as transformers names them
CLASSES = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLVisionConfig", "Qwen2VisionTransformerPretrainedModel"),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLVisionConfig", "Qwen2_5_VisionTransformerPretrainedModel"),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLVisionConfig", "Qwen3VLVisionModel"),
    "qwen3_vl_moe": ("qwen3_vl_moe", "Qwen3VLMoeVisionConfig", "Qwen3VLMoeVisionModel"),
    "qwen3_5": ("qwen3_5", "Qwen3_5VisionConfig", "Qwen3_5VisionModel"),
    "qwen3_5_moe": ("qwen3_5_moe", "Qwen3_5MoeVisionConfig", "Qwen3_5MoeVisionModel"),
}
_Q2 = dict(depth=2, embed_dim=32, hidden_size=48, mlp_ratio=4, num_heads=2, patch_size=14)
_Q25 = dict(depth=2, hidden_size=32, intermediate_size=72, num_heads=2, out_hidden_size=48)
_Q3 = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48)
SIZES = {
    "qwen2_vl": [
        _Q2,
        {**_Q2, "depth": 3, "embed_dim": 64, "mlp_ratio": 3, "spatial_merge_size": 3},
        {**_Q2, "embed_dim": 48, "hidden_size": 96, "patch_size": 8, "temporal_patch_size": 1},
    ],
    "qwen2_5_vl": [
        _Q25,
        {**_Q25, "depth": 4, "hidden_size": 64, "intermediate_size": 100, "spatial_merge_size": 1},
        {**_Q25, "patch_size": 16, "in_channels": 1, "out_hidden_size": 80},
    ],
    "qwen3_vl": [
        {**_Q3, "deepstack_visual_indexes": [0], "num_position_embeddings": 64},
        {**_Q3, "depth": 4, "deepstack_visual_indexes": [1, 2, 3], "num_position_embeddings": 100},
        {**_Q3, "hidden_size": 48, "patch_size": 8, "deepstack_visual_indexes": []},
    ],
    "qwen3_vl_moe": [{**_Q3, "deepstack_visual_indexes": [0, 1], "num_position_embeddings": 16}],
    "qwen3_5": [
        {**_Q3, "num_position_embeddings": 64},
        {**_Q3, "depth": 3, "hidden_size": 64, "intermediate_size": 96, "spatial_merge_size": 1},
        {**_Q3, "out_hidden_size": 128, "temporal_patch_size": 1, "num_position_embeddings": 36},
    ],
    "qwen3_5_moe": [{**_Q3, "depth": 3, "num_position_embeddings": 49}],
}
# vision_config of released checkpoints' config.json (the keys they carry), for the defaults path
RELEASED = {
    "qwen2_vl": dict(  # Qwen2-VL-7B-Instruct
        depth=32, embed_dim=1280, mlp_ratio=4, num_heads=16, in_chans=3, hidden_size=3584,
        patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
    ),
    "qwen2_5_vl": dict(  # Qwen2.5-VL-7B-Instruct
        depth=32, hidden_act="silu", hidden_size=1280, intermediate_size=3420, num_heads=16,
        in_chans=3, out_hidden_size=3584, patch_size=14, spatial_merge_size=2, window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31], tokens_per_second=2, temporal_patch_size=2,
    ),
    "qwen3_vl": dict(  # Qwen3-VL-8B-Instruct
        deepstack_visual_indexes=[8, 16, 24], depth=27, hidden_act="gelu_pytorch_tanh",
        hidden_size=1152, in_channels=3, intermediate_size=4304, model_type="qwen3_vl", num_heads=16,
        num_position_embeddings=2304, out_hidden_size=4096, patch_size=16, spatial_merge_size=2,
        temporal_patch_size=2,
    ),
    "qwen3_5": dict(depth=27, hidden_size=1152, out_hidden_size=2048),  # defaults for the rest
}  # fmt: skip


def transformers_count(model_type: str, vision: dict) -> int:
    module, config_cls, model_cls = CLASSES[model_type]
    mod = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=[model_cls])
    cfg_mod = __import__(f"transformers.models.{module}.configuration_{module}", fromlist=[config_cls])
    cfg = getattr(cfg_mod, config_cls)(**{k: v for k, v in vision.items() if k != "model_type"})
    with torch.device("meta"):
        model = getattr(mod, model_cls)(cfg)
    return sum(p.numel() for p in model.parameters())


CASES = [(mt, v) for mt, sizes in SIZES.items() for v in sizes]


@pytest.mark.parametrize(("model_type", "vision"), CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
def test_vision_count_matches_transformers(model_type: str, vision: dict):
    assert vision_param_count({"model_type": model_type, "vision_config": vision}) == transformers_count(
        model_type, vision
    )


@pytest.mark.parametrize("model_type", sorted(RELEASED))
def test_released_vision_configs_match_transformers(model_type: str):
    vision = RELEASED[model_type]
    n = vision_param_count({"model_type": model_type, "vision_config": vision})
    assert n == transformers_count(model_type, vision)
    assert 0.3e9 < n < 0.7e9  # the 0.4-0.7 B vision towers of the 7-8 B releases


def test_a_saved_composite_config_and_the_tiny_vlm(tmp_path):
    """config.json as save_pretrained writes it (to_dict: every key), and the tiny VLM's own tower."""
    from transformers import Qwen2_5_VLConfig

    vision = SIZES["qwen2_5_vl"][1]
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=100)
    saved = Qwen2_5_VLConfig(vision_config=vision, text_config=text).to_dict()
    arch = from_config(saved, "test")
    assert arch.vision_params == transformers_count("qwen2_5_vl", vision) and arch.hidden == 32

    from transformers import AutoModelForImageTextToText

    from hpcrl.models.tiny_vlm import build_tiny_vlm

    d = build_tiny_vlm(tmp_path / "vlm")
    model = AutoModelForImageTextToText.from_pretrained(str(d))
    import json

    arch = from_config(json.loads((d / "config.json").read_text()), "tiny")
    assert arch.vision_params == sum(p.numel() for p in model.model.visual.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert arch.params + arch.vision_params == total  # text + vision: the whole model


def test_no_vision_config_or_an_unknown_family_counts_nothing():
    assert vision_param_count({"model_type": "qwen3", "hidden_size": 8}) == 0
    assert vision_param_count({"model_type": "llava", "vision_config": {"hidden_size": 8}}) == 0
    # an old Qwen2-VL config.json names its parent in vision_config.model_type
    old = {"model_type": "qwen2_vl", **SIZES["qwen2_vl"][0]}
    assert vision_param_count({"vision_config": old}) == transformers_count("qwen2_vl", old)
