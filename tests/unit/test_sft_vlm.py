"""Vision-language SFT's pieces on a tiny Qwen3-VL built offline: image parts in every accepted form,
the placeholder expansion and loss mask, truncation that never splits an image, the forward, freezing,
and the one-line refusals of bad `[model.vlm]` values."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcrl.trainer import sft_data as sd


def png(color: tuple[int, int, int], size: tuple[int, int] = (32, 32)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hpcrl.models.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="module")
def vision(tiny_vlm: Path, tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoTokenizer

    from hpcrl.trainer.sft_vlm import VisionData

    base = tmp_path_factory.mktemp("images")
    (base / "red.png").write_bytes(png((255, 0, 0)))
    return VisionData(str(tiny_vlm), AutoTokenizer.from_pretrained(str(tiny_vlm)), base)


def conversation(*parts: dict) -> sd.Conversation:
    return sd.row_to_conversation(
        {
            "messages": [
                {"role": "user", "content": [*parts, {"type": "text", "text": "What color?"}]},
                {"role": "assistant", "content": "red"},
            ]
        }
    )


def test_every_image_form_reads_the_same_pixels(vision):
    from PIL import Image

    raw = png((255, 0, 0))
    b64 = base64.b64encode(raw).decode()
    forms = [
        {"type": "image", "image": "red.png"},  # relative to the data directory
        {"type": "image", "image": str(vision.base_dir / "red.png")},
        {"type": "image", "image": "file://" + str(vision.base_dir / "red.png")},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64}},
        {"type": "image", "image": b64},
        {"type": "image", "image": {"bytes": raw}, "image_url": None, "text": None},  # parquet's nulls
        {"type": "image", "image": Image.open(io.BytesIO(raw))},
    ]
    pixels = [vision.conversation(conversation(f), "row")[1]["pixel_values"] for f in forms]
    assert all(torch.equal(pixels[0], p) for p in pixels[1:])


def test_bad_images_are_one_line_data_errors(vision):
    for part, msg in (
        ({"type": "image", "image": "missing.png"}, "not a file nor base64"),
        ({"type": "image_url", "image_url": {"url": "https://x/y.png"}}, "not fetched"),
        ({"type": "image", "image": base64.b64encode(b"not an image").decode()}, "not an image"),
        ({"type": "audio", "audio": "x"}, "is not text or image"),
    ):
        with pytest.raises(sd.DataError, match=msg):
            vision.sample(conversation(part), {"assistant": True}, 512, "row 0")


def test_image_tokens_expand_and_only_the_answer_is_trained(vision):
    s = vision.sample(conversation({"type": "image", "image": "red.png"}), {"assistant": True}, 512, "r")
    tok = vision.tokenizer
    n_img = int((s.input_ids == vision.image_id).sum())
    assert n_img == int(s.mm["image_grid_thw"].prod()) // vision.merge**2 == 1  # 32 x 32: one token
    assert vision.placeholder == "<|vision_start|><|image_pad|><|vision_end|>"  # found in the template
    assert tok.decode(s.input_ids[s.loss_mask]) == "red<|im_end|>\n"
    assert not s.loss_mask[s.input_ids == vision.image_id].any()
    big = {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                    + base64.b64encode(png((0, 0, 255), (64, 64))).decode()}}  # fmt: skip
    two = vision.sample(
        conversation(big, {"type": "image", "image": "red.png"}), {"assistant": True}, 512, "r"
    )
    assert two.mm["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 2]]
    assert int((two.input_ids == vision.image_id).sum()) == 4 + 1


def test_truncation_never_splits_an_image(vision):
    from hpcrl.trainer.sft_vlm import truncate

    big = {"type": "image", "image": {"bytes": png((0, 0, 255), (64, 64))}}  # 4 tokens
    s = vision.sample(conversation({"type": "image", "image": "red.png"}, big), {"assistant": True}, 512, "r")
    ids = s.input_ids
    second = np.flatnonzero(ids == vision.image_id)[1:]  # the 64 x 64 image's 4 tokens
    cut = truncate(s, int(second[2]), vision.image_id, vision.merge)  # a cut inside it
    assert len(cut) == second[0] and cut.truncated
    assert cut.mm["image_grid_thw"].tolist() == [[1, 2, 2]]  # the first image only
    assert cut.mm["pixel_values"].shape[0] == 4  # its 2 x 2 patches
    none = truncate(s, int(np.flatnonzero(ids == vision.image_id)[0]), vision.image_id, vision.merge)
    assert none.mm is None and not (none.input_ids == vision.image_id).any()


def test_forward_matches_the_models_own_logits_and_freezing_drops_grads(vision, tiny_vlm):
    from transformers import AutoModelForImageTextToText

    from hpcrl.config.sections.vlm import VLMConfig
    from hpcrl.trainer.sft_vlm import forward_multimodal, micro_batches, prepare_model

    model = AutoModelForImageTextToText.from_pretrained(str(tiny_vlm))
    s = vision.sample(conversation({"type": "image", "image": "red.png"}), {"assistant": True}, 512, "r")
    (mb,) = micro_batches([s], vision.image_id, torch.device("cpu"))
    ids = mb.input_ids[None]
    ref = model(input_ids=ids, mm_token_type_ids=(ids == vision.image_id).long(), **mb.mm).logits[0]
    want = torch.log_softmax(ref[:-1].float(), -1).gather(1, ids[0, 1:, None])[:, 0]
    for chunk in (0, 3):
        lp = forward_multimodal(model, mb, wanted=mb.loss_mask, chunk_tokens=chunk).logprobs
        m = mb.loss_mask.clone()
        m[0] = False
        torch.testing.assert_close(lp[m], want[m[1:]], rtol=1e-5, atol=1e-5)
    assert prepare_model(model, VLMConfig())[0].startswith("vision encoder frozen")
    forward_multimodal(model, mb, wanted=mb.loss_mask).logprobs[mb.loss_mask].sum().backward()
    assert all(p.grad is None and not p.requires_grad for p in model.model.visual.parameters())
    assert model.model.language_model.layers[0].mlp.up_proj.weight.grad is not None
    with pytest.raises(ValueError, match=r"model.vlm.vision_encoder_attr: 'model.nope' does not resolve"):
        prepare_model(model, VLMConfig(vision_encoder_attr="model.nope"))


@pytest.mark.parametrize(
    "model_toml, field, msg",
    [
        ("[model.vlm]\nfreeze_vision_encoder = false\n[model.lora]\n", "model.vlm.freeze_vision_encoder",
         "incompatible with [lora]"),
        ("[model.vlm]\n", "model.impl", "no custom vision-language class"),  # --model.impl custom
        ('[model.vlm]\n[model.lora]\ntarget_modules = ["experts"]\n', "model.lora.target_modules",
         "['experts'] alone with [vlm]"),
        ("cp = 2\n[model.vlm]\n", "model.cp", "does not split images"),
        ('[model.vlm]\nvision_encoder_attr = "model..visual"\n', "model.vlm", "not a dotted attribute path"),
        ("[model.vlm]\nfreeze = true\n", "model.vlm", "freeze"),
        ('[model.vlm]\n[eval]\n[[eval.env]]\nid = "reverse-text"\n', "eval", "online evaluation"),
    ],
)  # fmt: skip
def test_bad_vlm_values_are_one_line_refusals(tmp_path, model_toml, field, msg):
    from hpcrl.config.loader import load
    from hpcrl.config.schema import SFTConfig
    from hpcrl.errors import ConfigError

    cfg = tmp_path / "sft.toml"
    cfg.write_text(
        f'output_dir = "{tmp_path / "run"}"\n[model]\nname = "hpcrl/tiny-qwen3"\n{model_toml}'
        '[data]\nname = "x.jsonl"\n'
    )
    with pytest.raises(ConfigError) as e:
        # a file's impl = "custom" is prime-rl's custom VLM class: read as auto (prime_shapes); a flag is not
        load([str(cfg), *(["--model.impl", "custom"] if field == "model.impl" else [])], SFTConfig)
    assert e.value.path.startswith(field) and msg in str(e.value) and "\n" not in str(e.value)


def test_rl_configs_take_vlm_and_refuse_what_sft_refuses_in_one_line(tmp_path):
    """`hpcrl run` with [model.vlm] (vision-language RL, tests/unit/test_vlm_rl.py): the same checks."""
    from hpcrl.config.loader import load
    from hpcrl.errors import ConfigError

    cfg = tmp_path / "rl.toml"
    cfg.write_text('[model]\nname = "hpcrl/tiny-qwen3"\n[trainer.model.vlm]\n')
    assert load([str(cfg)], require_envs=False).config.trainer.model.vlm.freeze_vision_encoder
    cfg.write_text('[model]\nname = "hpcrl/tiny-qwen3"\ncp = 2\n[model.vlm]\n')
    with pytest.raises(ConfigError, match="does not split images") as e:
        load([str(cfg)], require_envs=False)
    assert e.value.path == "model.cp"


def test_the_decoder_layers_of_a_vlm_are_its_language_models_not_its_vision_blocks():
    """Qwen2.5-VL-7B's vision tower has more blocks (32) than its language model has layers (28):
    FSDP units and activation checkpointing must still go to the language model's layers."""
    import torch
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

    from hpcrl.models.parallelize import decoder_layers

    text = dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=128, bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    vision = dict(depth=3, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(
            Qwen2_5_VLConfig(text_config=text, vision_config=vision | {"fullatt_block_indexes": [2]})
        )
    assert len(model.model.visual.blocks) == 3  # the longer list
    layers = decoder_layers(model)
    assert layers == list(model.model.language_model.layers)


def test_the_modules_model_vlm_names_decide_the_decoder_layers():
    """A tower under a name hpcrl does not know (`eyes`), with more blocks than the language model has
    layers: the modules that [model.vlm]'s attribute paths name (marked by prepare_model) decide."""
    from torch import nn

    from hpcrl.models.parallelize import LANGUAGE_MARK, VISION_MARK, decoder_layers

    class Tower(nn.Module):
        def __init__(self, n: int, name: str) -> None:
            super().__init__()
            setattr(self, name, nn.ModuleList(nn.Linear(2, 2) for _ in range(n)))

    model = nn.Module()
    model.eyes = Tower(5, "blocks")
    model.lm = Tower(3, "layers")
    assert decoder_layers(model) == list(model.eyes.blocks)  # unmarked: the longest list
    setattr(model.eyes, VISION_MARK, True)
    assert decoder_layers(model) == list(model.lm.layers)
    model.lm2 = Tower(4, "layers")  # the language model's lists only, once it is named
    setattr(model.lm, LANGUAGE_MARK, True)
    assert decoder_layers(model) == list(model.lm.layers)
