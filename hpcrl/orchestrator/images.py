"""The images of vision-language rollouts, from a sequence's image URLs to the tensors the trainer
forwards (`[model.vlm]` in `hpcrl run`).

The server got the images with the messages and returned the prompt ids with each image token
already expanded (hpcrl.inference.vision; vLLM does the same). Here the same images go through the
same image processor (hpcrl.models.vision_inputs.ImageInputs), and the count of image tokens in the
sequence's prompt part must be exactly what the processor's grids need: otherwise the trainer would
place image features at other positions than the sampler did, and the run ends, naming the cause. A
sequence whose *sampled* tokens include the image token (a weak model can sample it) cannot be
forwarded with its images (the model would look for one more image): it is dropped, and counted.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from hpcrl.errors import ConfigError

log = logging.getLogger("hpcrl.orchestrator")

MM = tuple[np.ndarray, np.ndarray]  # (pixel_values float32 [P, D], image_grid_thw int32 [I, 3])


def load_vision(cfg: Any, tokenizer: Any) -> Any:
    """The orchestrator's ImageInputs when the trained model is a vision-language one ([model.vlm]),
    else None."""
    model = cfg.trainer.model or cfg.model
    if model.vlm is None:
        return None
    from hpcrl.models.resolve import resolve_model
    from hpcrl.models.vision_inputs import ImageInputs

    name = (cfg.orchestrator.model or cfg.model).name or model.name or ""
    return ImageInputs(resolve_model(name), tokenizer, model.trust_remote_code)


class SampleImages:
    """Image tensors of sequences, cached by URL in an LRU of `cache_size` images (a group's rollouts
    share their prompt's images). Thread-safe: chat.py reads it from worker threads."""

    def __init__(self, vision: Any, cache_size: int = 256):
        self.vision, self.cache_size = vision, cache_size
        self.cache: OrderedDict[str, MM] = OrderedDict()
        self._lock = threading.Lock()
        self.seen = self.dropped = 0  # sequences with images; of them dropped (a sampled image token)

    def _one(self, ref: str) -> MM:
        with self._lock:
            hit = self.cache.get(ref)
            if hit is not None:
                self.cache.move_to_end(ref)
                return hit
        mm = self.vision.encode([ref], "rollout image")  # outside the lock: a slow processor call
        hit = (
            np.asarray(mm["pixel_values"].numpy(), np.float32),
            np.asarray(mm["image_grid_thw"].numpy(), np.int32),
        )
        with self._lock:
            self.cache[ref] = hit
            self.cache.move_to_end(ref)
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)  # the least recently used
        return hit

    def extra_tokens(self, refs: Sequence[str]) -> int:
        """Tokens the images' expansion adds to a rendering with one placeholder token per image."""
        return sum(self.vision.tokens_per_image(np.concatenate([self._one(r)[1] for r in refs]))) - len(refs)

    def of(self, images: Sequence[str] | None, input_ids: np.ndarray, where: str) -> MM | None:
        """(pixel_values, image_grid_thw) of one sequence's images, checked against its image tokens;
        None for a text sequence."""
        if not images:
            return None
        self.seen += 1
        parts = [self._one(r) for r in images]
        pixels = np.concatenate([p for p, _ in parts])
        grid = np.concatenate([g for _, g in parts])
        want = sum(self.vision.tokens_per_image(grid))
        got = int(np.count_nonzero(np.asarray(input_ids) == self.vision.image_id))
        if got != want:
            raise ValueError(
                f"{where}: {got} image tokens in the sequence, its {len(images)} image(s) need {want} "
                "(the server expanded the images differently from the model's image processor)"
            )
        return pixels, grid


DROP = (np.zeros((0, 0), np.float32), np.zeros((0, 3), np.int32))  # a sequence not to train on


def sample_images(images: SampleImages | None, piece: Any, where: str) -> MM | None:
    """A Piece's image tensors (None: a text piece; DROP: one that sampled the image token); a piece
    with images needs [model.vlm]."""
    if not piece.images:
        return None
    if images is None:
        raise ConfigError(
            "model.vlm",
            f"unset, but {where} has images: set [model.vlm] to train a vision-language model on them",
        )
    ids, sampled = np.asarray(piece.input_ids), np.asarray(piece.loss_mask, bool)
    if np.any(ids[sampled] == images.vision.image_id):
        images.dropped += 1
        log.warning(
            "%s sampled the image token: dropped (%d of %d sequences with images so far)",
            where,
            images.dropped,
            images.seen + 1,
        )
        return DROP
    return images.of(piece.images, np.where(sampled, -1, ids), where)
