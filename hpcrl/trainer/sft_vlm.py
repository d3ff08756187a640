"""Vision-language SFT (`[model.vlm]`): chat rows with image parts -> token ids, loss mask, and the
image tensors the model's own transformers class takes (pixel_values, image_grid_thw).

    row -> conversation -> each image part: the image processor's patches, and the template's image
    placeholder with its image token repeated once per merged patch -> the text conversation through
    hpcrl's incremental template rendering (same per-role loss masks as text SFT) -> truncation that
    never cuts an image's tokens (images past the cut are dropped, as prime-rl does)

A sample with images is its own micro-batch (:class:`VisionBatch`, not packed: each forward has the
model compute its multimodal RoPE positions from image_grid_thw) and goes through
:func:`forward_multimodal`; text-only rows of a VLM run are packed as usual. Image parts are
OpenAI's ``{"type": "image_url", "image_url": {"url": ...}}`` or HF's ``{"type": "image", "image": ...}``
(also ``path`` / ``url`` / ``bytes`` keys), the image as a ``data:image/...;base64,`` URL, plain
base64, raw bytes, ``{"bytes": ...}`` (parquet / HF datasets), a PIL image, or a local path (relative
to the data file's directory). Qwen-VL-style image processors (image_grid_thw, merge_size) only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from hpcrl.models import vision_inputs as vi
from hpcrl.models.chunked import can_chunk, head_logprobs, kept_logits
from hpcrl.trainer import sft_data as sd
from hpcrl.trainer.packing import ForwardOutput, PackedBatch, next_token_logprobs, sample_starts

log = logging.getLogger("hpcrl.trainer")

# model_type -> (vision encoder, language model) attribute paths, as prime-rl's VLM_REGISTRY
VLM_ATTRS = {
    t: ("model.visual", "model.language_model")
    for t in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
}


def resolve_attr(model: nn.Module, dotted: str) -> nn.Module | None:
    obj: Any = model.get_base_model() if hasattr(model, "get_base_model") else model
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, nn.Module) else None


def _attr(model: nn.Module, vlm: Any, which: int, name: str) -> nn.Module:
    given = getattr(vlm, name)
    mt = str(getattr(getattr(model, "config", None), "model_type", ""))
    path = given or VLM_ATTRS.get(mt, (None, None))[which]
    if path is None:
        raise ValueError(f"model.vlm.{name}: unset, and model_type {mt!r} has no known one; set it")
    mod = resolve_attr(model, path)
    if mod is None:
        raise ValueError(
            f"model.vlm.{name}: {path!r} does not resolve on this model ({type(model).__name__})"
        )
    return mod


def prepare_model(model: nn.Module, vlm: Any) -> list[str]:
    """Resolve the vision encoder and language model (a bad attribute path fails here, in one line)
    and freeze the encoder when asked (LoRA adapters inside it too): before the optimizer is built,
    so frozen weights have no optimizer state."""
    from hpcrl.models.parallelize import LANGUAGE_MARK, VISION_MARK

    vision = _attr(model, vlm, 0, "vision_encoder_attr")
    language = _attr(model, vlm, 1, "language_model_attr")
    # FSDP units and activation checkpointing take the language model's layers, never the encoder's
    # blocks (hpcrl.models.parallelize.decoder_layers)
    setattr(vision, VISION_MARK, True)
    setattr(language, LANGUAGE_MARK, True)
    n = sum(p.numel() for p in vision.parameters())
    if not vlm.freeze_vision_encoder:
        return [f"vision encoder trained ({n / 1e6:.2f}M parameters)"]
    for p in vision.parameters():
        p.requires_grad_(False)
    return [f"vision encoder frozen ({n / 1e6:.2f}M parameters: no gradients, no optimizer state)"]


def reduce_unused_grads(model: nn.Module, world: int) -> None:
    """A trained encoder on several ranks: a rank whose micro-batches carry no image leaves the
    encoder's gradients None, and FSDP2 would reduce-scatter fewer tensors there than on a rank whose
    micro-batches had images (a hang, or gradients paired with the wrong tensors). Zeros go in their
    place on every rank (FSDP2's reduce_scatter_unused_params)."""
    setter = getattr(model, "set_reduce_scatter_unused_params", None)
    if setter is None:
        import torch

        raise ValueError(
            f"model.vlm.freeze_vision_encoder: false on {world} ranks needs FSDP2's "
            f"set_reduce_scatter_unused_params, which torch {torch.__version__} lacks; freeze it or train on one rank"
        )
    setter(True)


# ---------------------------------------------------------------------------------------------
# images
# ---------------------------------------------------------------------------------------------
def _image_ref(part: dict[str, Any]) -> Any:
    return vi.image_ref(part, sd.DataError)


def load_image(ref: Any, base_dir: Path | None, where: str) -> Any:
    """A PIL RGB image from any of the forms the module doc lists (hpcrl.models.vision_inputs)."""
    return vi.load_image(ref, base_dir, where, sd.DataError)


@dataclass
class VisionSample(sd.TokenizedSample):
    """A tokenized sample with its images: pixel_values [patches, dim], image_grid_thw [images, 3]."""

    mm: dict[str, Tensor] | None = None


class VisionData:
    """The model's image processor and image token, and how one conversation becomes a sample."""

    def __init__(self, path: str, tokenizer: Any, base_dir: Path | None, trust_remote_code: bool = False):
        from transformers import AutoConfig

        # the image processor and image token RL's server and orchestrator use too (one expansion)
        inputs = vi.ImageInputs(path, tokenizer, trust_remote_code)
        self.processor, self.merge, self.image_id = inputs.processor, inputs.merge, inputs.image_id
        self.image_token = inputs.image_token
        self.tokenizer = tokenizer
        self.base_dir = base_dir
        self.placeholder = self._placeholder(
            AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        )

    def _placeholder(self, cfg: Any) -> str:
        """What the chat template writes for one image part (found by rendering one between two
        markers), else <vision_start><image><vision_end> from the config's token ids."""
        msg = [{"role": "user", "content": [{"type": "text", "text": "\x01"}, {"type": "image"},
                                             {"type": "text", "text": "\x02"}]}]  # fmt: skip
        try:
            text = self.tokenizer.apply_chat_template(msg, tokenize=False)
            between = text[text.index("\x01") + 1 : text.index("\x02")]
        except Exception:  # a template without content parts
            between = ""
        if between.count(self.image_token) == 1:
            return between
        ends = [getattr(cfg, k, None) for k in ("vision_start_token_id", "vision_end_token_id")]
        if all(e is not None for e in ends):
            start, end = self.tokenizer.convert_ids_to_tokens([int(e) for e in ends])
            return f"{start}{self.image_token}{end}"
        return self.image_token

    def conversation(
        self, conv: sd.Conversation, where: str
    ) -> tuple[sd.Conversation, dict[str, Tensor] | None]:
        """Image parts -> placeholders of the right length (text parts joined), and the images' tensors."""
        pixels: list[Tensor] = []
        grids: list[Tensor] = []
        messages = []
        for i, m in enumerate(conv.messages):
            content = m.get("content")
            if not isinstance(content, list):
                messages.append(m)
                continue
            text = []
            for j, part in enumerate(content):
                if isinstance(part, str):
                    text.append(part)
                    continue
                if not isinstance(part, dict):
                    raise sd.DataError(f"{where}.messages[{i}].content[{j}]: expected an object")
                part = {k: v for k, v in part.items() if v is not None}  # noqa: PLW2901 - Arrow's union nulls
                ref = _image_ref(part)
                if ref is None:
                    if part.get("type", "text") != "text":
                        raise sd.DataError(
                            f"{where}.messages[{i}].content[{j}]: type {part['type']!r} is not text or image"
                        )
                    text.append(str(part.get("text") or ""))
                    continue
                img = load_image(ref, self.base_dir, f"{where}.messages[{i}].content[{j}]")
                out = self.processor(images=[img], return_tensors="pt")
                pixels.append(out["pixel_values"])
                grids.append(out["image_grid_thw"])
                n = int(out["image_grid_thw"].prod()) // self.merge**2
                text.append(self.placeholder.replace(self.image_token, self.image_token * n))
            messages.append({**m, "content": "".join(text)})
        mm = None if not pixels else {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.cat(grids)}
        return replace(conv, messages=messages), mm

    def sample(
        self, conv: sd.Conversation, role_mask: dict[str, bool], seq_len: int, where: str
    ) -> sd.TokenizedSample:
        conv, mm = self.conversation(conv, where)
        s = sd.tokenize_conversation(self.tokenizer, conv, role_mask, where)
        n_img = int((s.input_ids == self.image_id).sum())
        want = 0 if mm is None else int(mm["image_grid_thw"].prod(-1).sum()) // self.merge**2
        if n_img != want:
            raise sd.DataError(f"{where}: {n_img} image tokens after rendering, the images need {want}")
        if mm is None:
            return sd.truncate(s, seq_len)
        return truncate(VisionSample(s.input_ids, s.loss_mask, mm=mm), seq_len, self.image_id, self.merge)


def truncate(s: VisionSample, seq_len: int, image_id: int, merge: int) -> VisionSample:
    """Cut at seq_len, or before the image whose tokens it would split; images past the cut dropped."""
    if len(s) <= seq_len:
        return s
    assert s.mm is not None
    is_img = s.input_ids == image_id
    cut = seq_len
    while cut > 0 and is_img[cut - 1] and is_img[cut]:  # inside an image's run: back to its start
        cut -= 1
    grid = s.mm["image_grid_thw"]
    per_image = (grid.prod(-1) // merge**2).tolist()
    kept, tokens = 0, int(is_img[:cut].sum())
    while kept < len(per_image) and tokens >= per_image[kept]:
        tokens -= per_image[kept]
        kept += 1
    patches = int(grid[:kept].prod(-1).sum())
    mm = (
        None if kept == 0 else {"pixel_values": s.mm["pixel_values"][:patches], "image_grid_thw": grid[:kept]}
    )
    return VisionSample(s.input_ids[:cut], s.loss_mask[:cut], truncated=True, mm=mm)


# ---------------------------------------------------------------------------------------------
# micro-batches and the forward
# ---------------------------------------------------------------------------------------------
@dataclass
class VisionBatch(PackedBatch):
    """One sample with images: its own micro-batch."""

    mm: dict[str, Tensor] = field(default_factory=dict)
    image_id: int = -1

    def to(self, device: torch.device | str) -> VisionBatch:
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(PackedBatch)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return replace(self, **moved, mm={k: v.to(device) for k, v in self.mm.items()})


def micro_batches(samples: list[VisionSample], image_id: int, device: torch.device) -> list[VisionBatch]:
    out = []
    for s in samples:
        n = len(s)
        mb = VisionBatch(
            input_ids=torch.from_numpy(s.input_ids.astype(np.int64)),
            position_ids=torch.arange(n),
            seq_lens=torch.tensor([n]),
            loss_mask=torch.from_numpy(s.loss_mask),
            mm=dict(s.mm or {}),
            image_id=image_id,
        )
        out.append(mb.to(device))
    return out


def forward_multimodal(
    model: nn.Module,
    mb: VisionBatch,
    *,
    compute_entropy: bool = True,
    wanted: Tensor | None = None,
    chunk_tokens: int = 0,
) -> ForwardOutput:
    """One sample with its images through the model's own forward (it places the image features and
    computes its multimodal positions), logprobs of the wanted tokens as forward_packed returns them
    (at the sample's sampling temperature when the micro-batch has one: RL)."""
    dev = mb.input_ids.device
    t = mb.num_tokens
    target = torch.ones(t, dtype=torch.bool, device=dev) if wanted is None else wanted.to(dev).bool().clone()
    target[sample_starts(mb.seq_lens.to(dev))] = False
    keep = torch.zeros_like(target)
    keep[:-1] = target[1:]  # position p predicts token p + 1
    pos = keep.nonzero()[:, 0]
    ids = mb.input_ids[None]
    inputs: dict[str, Any] = {"input_ids": ids, **mb.mm}
    if mb.mm:
        inputs["mm_token_type_ids"] = (ids == mb.image_id).long()  # Qwen3-VL's M-RoPE asks for it
    if mb.routed_experts is not None:  # router replay (a VL MoE: hpcrl.models.vlm_moe's hook)
        inputs["routed_experts"] = mb.routed_experts[None]
    labels = mb.input_ids[pos + 1]
    temp = 1.0 if mb.temperatures is None else float(mb.temperatures[0])  # RL: the sampling temperature
    if chunk_tokens > 0 and can_chunk(model):
        picked, ent_p = head_logprobs(
            model, inputs, keep[None], labels, temp, chunk=chunk_tokens, entropy=compute_entropy
        )
    else:
        logits = kept_logits(model, inputs, keep[None])
        picked, ent_p = next_token_logprobs(logits, labels, temp, entropy=compute_entropy)
    lp = torch.zeros(t, dtype=picked.dtype, device=dev).index_copy(0, pos + 1, picked)
    ent = (
        None if ent_p is None else torch.zeros(t, dtype=ent_p.dtype, device=dev).index_copy(0, pos + 1, ent_p)
    )
    return ForwardOutput(logprobs=lp, entropy=ent, slots=t, padding=0)
