"""Images of a vision-language model's chat messages: what the server, the orchestrator and the
trainer must compute identically.

    image_ref / load_image   an image part (OpenAI ``image_url``, HF ``image``) -> a PIL RGB image
    image_refs(messages)     every image part of a conversation, in prompt order
    ImageInputs(path)        the model's image processor and image token: images -> pixel_values
                             [patches, dim] + image_grid_thw [images, 3], and the rendered prompt
                             with each image token repeated once per merged patch

A prompt's image token ids are expanded exactly once, from the processor's grid (Qwen-VL style:
``prod(grid_thw) // merge_size**2`` tokens per image), so the server's prompt ids, the ids the
orchestrator trains on and the ids the trainer's forward places image features at are the same.
Images are given as ``data:image/...;base64,`` URLs, plain base64, raw bytes, ``{"bytes": ...}``,
a PIL image, or a local path (relative to ``base_dir``); http(s) URLs are not fetched.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DATA_URL = re.compile(
    r"^data:image/[A-Za-z0-9.+-]+;base64,", re.ASCII
)  # what the engine and the trainer take


def image_ref(part: dict[str, Any], error: type[Exception] = ValueError) -> Any:
    """The image an image part names (None: not an image part)."""
    kind = part.get("type")
    if kind == "image_url" or "image_url" in part:
        ref = part.get("image_url")
        return ref.get("url") if isinstance(ref, dict) else ref
    if kind == "image" or (kind is None and "image" in part):
        for key in ("image", "path", "url", "bytes"):
            if part.get(key) is not None:
                return part[key]
        raise error("an image part has no image (keys image / path / url / bytes)")
    return None


def image_refs(messages: Sequence[dict[str, Any]]) -> list[Any]:
    """The images of every message's content parts, in order ([] for a text conversation)."""
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for part in content:
                ref = image_ref(part) if isinstance(part, dict) else None
                if ref is not None:
                    out.append(ref)
    return out


def load_image(ref: Any, base_dir: Path | None, where: str, error: type[Exception] = ValueError) -> Any:
    """A PIL RGB image from any of the forms the module doc lists; `error` names `where`."""
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    if isinstance(ref, dict) and ref.get("bytes") is not None:
        ref = ref["bytes"]
    elif isinstance(ref, dict) and ref.get("path"):
        ref = ref["path"]
    if isinstance(ref, str):
        if DATA_URL.match(ref):
            ref = base64.b64decode(ref.split(",", 1)[1])
        elif ref.startswith(("http://", "https://")):
            raise error(f"{where}: image URLs are not fetched ({ref[:60]}); give a local path or base64")
        else:
            path = Path(ref.removeprefix("file://"))
            if not path.is_absolute() and base_dir is not None:
                path = base_dir / path
            if path.is_file():
                ref = path.read_bytes()
            else:
                try:
                    ref = base64.b64decode(ref, validate=True)
                except (binascii.Error, ValueError):
                    raise error(f"{where}: image {str(ref)[:60]!r} is not a file nor base64") from None
    if not isinstance(ref, (bytes, bytearray)):
        raise error(f"{where}: cannot read an image from {type(ref).__name__}")
    try:
        return Image.open(io.BytesIO(ref)).convert("RGB")
    except Exception as e:  # PIL raises several kinds for bad bytes
        raise error(f"{where}: not an image ({e})") from None


def is_vision_model(path: str, trust_remote_code: bool = False) -> bool:
    """Whether the model directory is a vision-language model (its config has a vision_config)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return getattr(cfg, "vision_config", None) is not None


class ImageInputs:
    """A vision-language model's image processor and image token (Qwen-VL style processors only:
    image_grid_thw, merge_size, image_token_id)."""

    def __init__(self, path: str, tokenizer: Any, trust_remote_code: bool = False, field: str = "model.vlm"):
        from transformers import AutoConfig, AutoImageProcessor

        cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.merge = getattr(self.processor, "merge_size", None)
        image_id = getattr(cfg, "image_token_id", None)
        if self.merge is None or image_id is None:
            raise ValueError(
                f"{field}: {cfg.model_type}'s image processor ({type(self.processor).__name__}) is not "
                "Qwen-VL-style (image_grid_thw, merge_size, image_token_id): hpcrl reads those only"
            )
        self.image_id = int(image_id)
        self.image_token = tokenizer.convert_ids_to_tokens(self.image_id)

    def encode(
        self, refs: Sequence[Any], where: str = "image", base_dir: Path | None = None
    ) -> dict[str, Any]:
        """pixel_values [patches, dim] (float32) and image_grid_thw [images, 3] (int64) torch tensors of
        the images, one processor call per image (as the trainer's SFT samples are made)."""
        import torch

        pixels, grids = [], []
        for i, ref in enumerate(refs):
            out = self.processor(images=[load_image(ref, base_dir, f"{where}[{i}]")], return_tensors="pt")
            pixels.append(out["pixel_values"].float())
            grids.append(out["image_grid_thw"].long())
        return {"pixel_values": torch.cat(pixels), "image_grid_thw": torch.cat(grids)}

    def tokens_per_image(self, grid: Any) -> list[int]:
        """Image tokens each image takes in the prompt: its merged patches."""
        return [int(g[0]) * int(g[1]) * int(g[2]) // self.merge**2 for g in grid.tolist()]

    def expand(self, text: str, counts: Sequence[int], where: str = "messages") -> str:
        """The template's rendering with its k-th image token repeated counts[k] times."""
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(counts):
            raise ValueError(
                f"{where}: the chat template wrote {len(pieces) - 1} image placeholders for {len(counts)} images"
            )
        out = [pieces[0]]
        for n, rest in zip(counts, pieces[1:]):
            out.append(self.image_token * n + rest)
        return "".join(out)
