"""Vision-language RL (`[model.vlm]` in `hpcrl run`): the samples of a TrainBatch that carry images
leave the packed batch, each as its own micro-batch (hpcrl.trainer.sft_vlm.VisionBatch, the SFT path's:
the model's own forward places the image features and computes its multimodal RoPE positions); the
text samples stay packed. The loss sees the same per-token fields either way."""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import torch

from hpcrl.bus import TrainBatch
from hpcrl.trainer.packing import PackedBatch
from hpcrl.trainer.sft_vlm import VisionBatch


def split_vision(
    packed: PackedBatch, batch: TrainBatch, image_id: int | None, device: torch.device
) -> tuple[PackedBatch, list[VisionBatch]]:
    """(the text samples, packed; one VisionBatch per sample with images), in batch order."""
    images = batch.images
    if images is None or not images.images_per_sample.any():
        return packed, []
    if image_id is None:
        raise ValueError(
            "model.vlm: the batch has images but the trained model has no image_token_id (not a vision-language model)"
        )
    per = images.images_per_sample.tolist()
    on_device: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # each distinct image moved once

    def image(u: int) -> tuple[torch.Tensor, torch.Tensor]:
        if u not in on_device:
            pixels, grid = images.image(u)  # views of the decoded batch: no host copy
            on_device[u] = (
                torch.as_tensor(np.asarray(pixels, np.float32)).to(device),
                torch.as_tensor(np.asarray(grid)).to(device, torch.int64),
            )
        return on_device[u]

    vision = []
    for i, n in enumerate(per):
        if not n:
            continue
        one = packed.select_samples([i])
        parts = [image(u) for u in images.sample_images(i)]
        mm = {
            "pixel_values": parts[0][0] if len(parts) == 1 else torch.cat([p for p, _ in parts]),
            "image_grid_thw": parts[0][1] if len(parts) == 1 else torch.cat([g for _, g in parts]),
        }
        vision.append(
            VisionBatch(
                **{f.name: getattr(one, f.name) for f in fields(PackedBatch)}, mm=mm, image_id=image_id
            )
        )
    return packed.select_samples([i for i, n in enumerate(per) if not n]), vision


def image_token_id(model: torch.nn.Module) -> int | None:
    value = getattr(getattr(model, "config", None), "image_token_id", None)
    return None if value is None else int(value)
