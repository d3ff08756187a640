"""A tiny Qwen3-VL (vision-language) model directory built offline, for tests and CPU demos of
`hpcrl sft` with `[model.vlm]`: hpcrl's locally trained BPE (:func:`hpcrl.models.tiny.build_tokenizer`)
plus Qwen-VL's vision tokens, a 2-layer text model, a 1-block vision encoder, and the processor files
(the image processor's preprocessor_config.json, the tokenizer with its chat template).

    build_tiny_vlm(out_dir, seed=0) -> Path
    build_tiny_vlm(out_dir, seed=0, moe=True) -> Path   # Qwen3-VL-MoE: 8 experts, top-2, every layer


The chat template renders an image part as Qwen-VL's do (``<|vision_start|><|image_pad|><|vision_end|>``);
the processor expands ``<|image_pad|>`` to one token per merged 32 x 32 patch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

# ChatML with OpenAI / HF content parts: text parts as their text, image parts as Qwen-VL's placeholder.
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tiny_vlm(out_dir: str | Path, seed: int = 0, moe: bool = False) -> Path:
    """Write a tiny Qwen3-VL directory (config, weights, tokenizer, processor) to ``out_dir``;
    ``moe``: a Qwen3-VL-MoE (model_type qwen3_vl_moe, every text layer a sparse MoE block)."""
    import torch
    from tokenizers import AddedToken
    from transformers import (
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeConfig,
        Qwen3VLMoeForConditionalGeneration,
    )
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from hpcrl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS], special_tokens=True
    )
    tok.chat_template = VLM_CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = _text_config(len(tok), tok)
    if moe:  # E = 8 experts of width 32, top-2 (softmax, renormalized: transformers' router)
        text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    config_cls, model_cls = (
        (Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration)
        if moe
        else (Qwen3VLConfig, Qwen3VLForConditionalGeneration)
    )
    cfg = config_cls(
        text_config=text,
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            deepstack_visual_indexes=[0],
            num_position_embeddings=64,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = model_cls(cfg)
    if moe:  # transformers initialises the stacked experts and the router to zeros / empty: N(0, 0.02)
        for name, p in model.named_parameters():
            if ".mlp.experts." in name or name.endswith(".mlp.gate.weight"):
                torch.nn.init.normal_(p, std=0.02)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    size = {"shortest_edge": 32 * 32, "longest_edge": 64 * 64}  # 32..64 px images: 1..4 image tokens
    image = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, size=size)
    image.save_pretrained(out)  # preprocessor_config.json (no video processor: it needs torchvision)
    tok.save_pretrained(out)
    return out


def _text_config(vocab: int, tok: Any) -> dict[str, Any]:
    return dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=vocab,
        max_position_embeddings=4096,
        rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
