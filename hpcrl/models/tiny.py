"""Tiny Qwen3-style models and a locally trained byte-level BPE tokenizer.

Tests and CPU demos must never touch the hub, so everything here is built from code: a fixed,
generated corpus trains the tokenizer (deterministically), a seeded init builds the weights, and the
result is saved as an ordinary Hugging Face directory that transformers and vLLM both load.

    build_tiny_model(out_dir, preset="tiny", seed=0, template="chatml") -> Path
    hpcrl.models.resolve.resolve_model("hpcrl/tiny-qwen3") builds one into the cache on first use;
    "hpcrl/tiny-qwen3-think" is the same model with Qwen3's chat template and added tokens (<think>,
    <tool_call>, <tool_response>): the real `qwen3` renderer works with it
    hpcrl make-tiny-model DIR [--preset tiny|small] [--seed N] [--template chatml|qwen3]  (main(argv))

torch / transformers / tokenizers are imported inside the functions: resolving a name on a warm cache
and the CLI's argument parsing stay light.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

# Bump when the corpus, template or architecture changes: cached built-in models are rebuilt.
KIT_VERSION = 1

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END]

VOCAB_SIZE = 400

PRESETS: dict[str, dict[str, int]] = {
    # ~0.34 M parameters: fast enough for every unit and integration test.
    "tiny": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
    # ~2.5 M parameters: big enough for demos that must visibly learn on CPU.
    "small": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    # The tiny model at Qwen3's vocabulary (151,936; ids past the tokenizer's 400 decode to nothing)
    # and 40,960 positions: the LM head dominates memory as in a real model (19.4 M parameters, all
    # but 0.3 M of them the tied embedding), for long-sequence tests and scripts/bench/long_seq.py.
    "tiny-151k": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=151_936,
        max_position_embeddings=40_960,
    ),
    # ~53 M parameters (212 MB in fp32): big enough that the trainer benchmark's memory table shows
    # what meta-device init saves; not a built-in name, only `build_tiny_model(..., preset="medium")`.
    "medium": dict(
        hidden_size=640,
        intermediate_size=1792,
        num_hidden_layers=12,
        num_attention_heads=10,
        num_key_value_heads=2,
        head_dim=64,
    ),
}


# Qwen/ChatML-style template. Tools are listed as JSON in the system turn and assistant tool calls
# are rendered as <tool_call>JSON</tool_call>, as Qwen does, so tool-using environments work with the
# tiny model exactly as with a real one. The rendering of a conversation is a prefix of the rendering
# of any continuation of it (no reasoning stripping), which exact multi-turn stitching relies on.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Available tools:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall a tool with <tool_call>{"name": ..., "arguments": ...}</tool_call>\''
    " + '<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- if not loop.first %}"
    "{{- '<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message['content'] %}{{- message['content'] }}{%- endif %}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{%- for tc in message['tool_calls'] %}"
    "{%- set fn = tc['function'] if tc['function'] is defined else tc %}"
    "{%- if (loop.first and message['content']) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}"
    "{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>tool\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS_TEXT = (
    "the a an and or not is are was be to of in on at by for with from as it this that these those "
    "you your we our they their he she his her i me my yes no true false answer question reverse "
    "text sort sorted alphabet alphabetical order letters letter word words number numbers sum add "
    "plus minus times divided equals result correct wrong please think step solve compute count "
    "first second last next before after output input string list call tool function name arguments "
    "system user assistant tool_call tool_response hello world example test reward good bad "
    "quick brown fox jumps over lazy dog apple banana cherry orange lemon grape water fire earth "
    "red green blue black white small large big little one two three four five six seven eight nine ten"
)
_WORDS = _WORDS_TEXT.split()


def _corpus(seed: int = 1234) -> list[str]:
    """A small, fixed training corpus: words, letters, digits, arithmetic, punctuation, chat pieces."""
    rng = random.Random(seed)  # fixed: the tokenizer must not depend on the model seed
    letters = "abcdefghijklmnopqrstuvwxyz"
    lines: list[str] = [letters, letters.upper(), "0123456789", "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"]
    for _ in range(400):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        if rng.random() < 0.3:
            words[0] = words[0].capitalize()
        lines.append(" ".join(words) + rng.choice([".", "?", "!", ",", ":", ""]))
    for _ in range(300):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*/")
        lines.append(f"{a} {op} {b} = {rng.randint(0, 9999)}")
    for _ in range(200):
        w = "".join(rng.choice(letters) for _ in range(rng.randint(3, 10)))
        lines.append(f"Reverse: {w} -> {w[::-1]}; sorted: {' '.join(sorted(w))}")
    for _ in range(100):
        lines.append(
            f'<tool_call>{{"name": "{rng.choice(_WORDS)}", "arguments": {{"x": {rng.randint(0, 99)}}}}}'
            "</tool_call>"
        )
        lines.append(
            f"{IM_START}{rng.choice(['system', 'user', 'assistant', 'tool'])}\n"
            f"{' '.join(rng.choice(_WORDS) for _ in range(5))}{IM_END}\n"
        )
    return lines


TEMPLATES = ("chatml", "qwen3")


def build_tokenizer(template: str = "chatml") -> Any:
    """Train the byte-level BPE tokenizer and wrap it in PreTrainedTokenizerFast (deterministic).

    `template="qwen3"`: the same BPE plus Qwen3's added tokens and Qwen3's own chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits split one by one (as Qwen does) so arithmetic is tokenized uniformly.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=None,
        bos_token=None,
        model_max_length=2048,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    if template == "qwen3":
        from hpcrl.models.qwen3_template import QWEN3_ADDED_TOKENS, QWEN3_CHAT_TEMPLATE

        fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN3_ADDED_TOKENS])
        fast.chat_template = QWEN3_CHAT_TEMPLATE
    elif template != "chatml":
        raise ValueError(f"unknown tiny-model template {template!r}; allowed: {', '.join(TEMPLATES)}")
    return fast


# Qwen3-MoE presets (every layer sparse, 8 experts, top-2): the seeds' MoE family at CPU size.
MOE_PRESETS: dict[str, dict[str, int]] = {
    # ~0.6 M parameters
    "tiny-moe": dict(
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
    # ~5 M parameters: the benchmark's "small MoE"
    "small-moe": dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_experts=16,
        num_experts_per_tok=2,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    # Qwen3-30B-A3B's routing shape (48 sparse layers, 128 experts, top-8) at hidden 64, ~40 M
    # parameters: where routing mismatch has the seeds' number of near-tied choices per token
    "deep-moe": dict(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=128,
        num_experts_per_tok=8,
        num_hidden_layers=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
}


def _common_config(tokenizer: Any) -> dict[str, Any]:
    """What every tiny preset, dense or MoE, shares: the tokenizer's ids, tied embeddings, fp32."""
    return dict(
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )


def _model_config(preset: str, tokenizer: Any) -> Any:
    from transformers import Qwen3Config, Qwen3MoeConfig

    if preset in MOE_PRESETS:  # every layer sparse
        moe = dict(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
        return Qwen3MoeConfig(**{**_common_config(tokenizer), **moe, **MOE_PRESETS[preset]})
    if preset not in PRESETS:
        raise ValueError(f"unknown tiny-model preset {preset!r}; allowed: {sorted(PRESETS | MOE_PRESETS)}")
    return Qwen3Config(**{**_common_config(tokenizer), **PRESETS[preset]})


def build_tiny_model(
    out_dir: str | Path, preset: str = "tiny", seed: int = 0, template: str = "chatml"
) -> Path:
    """Build a tiny Qwen3 (or Qwen3-MoE: MOE_PRESETS) causal LM + tokenizer as a Hugging Face directory.

    Building twice with the same preset and seed gives bit-identical files' tensors. `template`:
    "chatml" (hpcrl's prefix-stable ChatML) or "qwen3" (Qwen3's think-stripping template).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(template)
    config = _model_config(preset, tokenizer)
    # fork_rng keeps a caller's global RNG untouched while making the init depend only on `seed`.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.eval()
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "hpcrl_tiny.json").write_text(
        json.dumps({"kit_version": KIT_VERSION, "preset": preset, "seed": seed, "template": template})
    )
    return out


def main(argv: list[str] | None = None) -> int:
    """`hpcrl make-tiny-model DIR [--preset tiny|small] [--seed N] [--template chatml|qwen3]`."""
    parser = argparse.ArgumentParser(
        prog="hpcrl make-tiny-model", description="Build a tiny Qwen3-style model + BPE tokenizer locally."
    )
    parser.add_argument("dir", help="output directory (a Hugging Face model dir)")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS | MOE_PRESETS),
        default="tiny",
        help="model size; tiny-moe / small-moe / deep-moe build a Qwen3-MoE (8 / 16 experts, top-2; 128 top-8)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight init seed")
    parser.add_argument(
        "--template",
        choices=TEMPLATES,
        default="chatml",
        help="chat template: chatml (prefix-stable) or qwen3 (Qwen3's template and special tokens: "
        "<think> stripped from earlier turns, <tool_call>/<tool_response>; the qwen3 renderer accepts it)",
    )
    args = parser.parse_args(argv)
    out = build_tiny_model(args.dir, preset=args.preset, seed=args.seed, template=args.template)
    n_params = _count_params(out)
    print(f"built {args.preset} model ({n_params / 1e6:.2f} M params, {args.template} template) in {out}")
    return 0


def _count_params(path: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for k in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            n = 1
            for d in f.get_slice(k).get_shape():
                n *= d
            total += n
    return total


if __name__ == "__main__":
    raise SystemExit(main())
