"""The images of a TrainBatch's samples (vision-language RL), an optional part of the batch. Each
distinct image is stored once (a group's rollouts share their prompt's image: a group of 16 ships
one copy, not 16), and the samples name theirs by index:

    pixel_values       float32 [P, D]  the distinct images' patches as the model's image processor
                                       made them (hpcrl.models.vision_inputs), image after image
    image_grid_thw     int32   [U, 3]  each distinct image's (temporal, height, width) patch grid:
                                       image u owns prod(grid[u]) rows of pixel_values
    image_index        int32   [I]     the samples' images in sample order, each an index into the
                                       distinct images (None: 0, 1, ..., U - 1, every image distinct)
    images_per_sample  int32   [S]     how many of those images each sample has (0: a text sample)

A batch file written before this part existed decodes with `TrainBatch.images = None`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec
import numpy as np


class ImageBatch(msgspec.Struct, kw_only=True, eq=False):
    pixel_values: np.ndarray
    image_grid_thw: np.ndarray
    images_per_sample: np.ndarray
    image_index: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.pixel_values = np.asarray(self.pixel_values, dtype=np.float32)
        self.image_grid_thw = np.asarray(self.image_grid_thw, dtype=np.int32)
        self.images_per_sample = np.asarray(self.images_per_sample, dtype=np.int32)
        if self.image_index is not None:
            self.image_index = np.asarray(self.image_index, dtype=np.int32)
        if self.pixel_values.ndim != 2:
            raise ValueError(
                f"ImageBatch.pixel_values must be [patches, dim], got shape {self.pixel_values.shape}"
            )
        if self.image_grid_thw.ndim != 2 or self.image_grid_thw.shape[1] != 3:
            raise ValueError(
                f"ImageBatch.image_grid_thw must be [images, 3], got shape {self.image_grid_thw.shape}"
            )
        if self.images_per_sample.ndim != 1 or (self.images_per_sample < 0).any():
            raise ValueError("ImageBatch.images_per_sample must be 1-D and >= 0")
        if (self.image_grid_thw <= 0).any():
            raise ValueError("ImageBatch.image_grid_thw must be positive")
        n_img = int(self.images_per_sample.sum(dtype=np.int64))
        index = self.index
        if n_img != len(index):
            raise ValueError(
                f"ImageBatch.images_per_sample sums to {n_img}, the samples have {len(index)} images"
            )
        if self.image_index is not None and (
            self.image_index.ndim != 1 or ((index < 0) | (index >= len(self.image_grid_thw))).any()
        ):
            raise ValueError(f"ImageBatch.image_index must be 1-D in [0, {len(self.image_grid_thw)})")
        rows = self.image_grid_thw.astype(np.int64).prod(-1)
        if int(rows.sum()) != len(self.pixel_values):
            raise ValueError(
                f"ImageBatch.image_grid_thw covers {int(rows.sum())} patches, pixel_values has {len(self.pixel_values)}"
            )

    @property
    def index(self) -> np.ndarray:
        """Each sample image's distinct image (sample order)."""
        return (
            np.arange(len(self.image_grid_thw), dtype=np.int32)
            if self.image_index is None
            else self.image_index
        )

    def image(self, u: int) -> tuple[np.ndarray, np.ndarray]:
        """(pixel_values, image_grid_thw [1, 3]) of distinct image u (views)."""
        p0 = int(self.image_grid_thw[:u].astype(np.int64).prod(-1).sum())
        p1 = p0 + int(np.prod(self.image_grid_thw[u], dtype=np.int64))
        return self.pixel_values[p0:p1], self.image_grid_thw[u : u + 1]

    def sample_images(self, i: int) -> list[int]:
        """The distinct images of sample i, in its prompt order."""
        first = int(self.images_per_sample[:i].sum(dtype=np.int64))
        return self.index[first : first + int(self.images_per_sample[i])].tolist()

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(pixel_values, image_grid_thw) of sample i (views when it has one image; zero rows for a
        text sample)."""
        parts = [self.image(u) for u in self.sample_images(i)]
        if not parts:
            return self.pixel_values[:0], self.image_grid_thw[:0]
        if len(parts) == 1:
            return parts[0]
        return np.concatenate([p for p, _ in parts]), np.concatenate([g for _, g in parts])


def _split(pixels: np.ndarray, grid: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """One sample's (pixel_values, image_grid_thw) as one (pixels, grid [1, 3]) per image."""
    out, p0 = [], 0
    for g in grid:
        p1 = p0 + int(np.prod(g, dtype=np.int64))
        out.append((pixels[p0:p1], g.reshape(1, 3)))
        p0 = p1
    return out


def join_images(
    per_sample: Sequence[tuple[np.ndarray, np.ndarray] | None], dim: int | None = None
) -> ImageBatch | None:
    """One ImageBatch of samples' (pixel_values, image_grid_thw) (None: a text sample), each distinct
    image (by content hash) stored once; None when no sample has an image."""
    if all(x is None or len(x[1]) == 0 for x in per_sample):
        return None
    dims = {x[0].shape[1] for x in per_sample if x is not None and len(x[1])}
    if len(dims) != 1:
        raise ValueError(f"samples' pixel_values have different widths {sorted(dims)}")
    (d,) = dims if dim is None else (dim,)
    seen: dict[bytes, int] = {}
    by_id: dict[int, int] = {}  # the same array object (SampleImages' cache): no need to hash again
    pix: list[np.ndarray] = []
    grids: list[np.ndarray] = []
    index: list[int] = []
    for x in per_sample:
        if x is None:
            continue
        for p, g in _split(np.asarray(x[0], np.float32), np.asarray(x[1], np.int32).reshape(-1, 3)):
            u = by_id.get(id(x[0])) if len(x[1]) == 1 else None
            if u is None:
                h = hashlib.blake2b(g.tobytes(), digest_size=16)
                h.update(np.ascontiguousarray(p))
                key = h.digest()
                u = seen.get(key)
                if u is None:
                    u = seen[key] = len(grids)
                    pix.append(p)
                    grids.append(g)
                if len(x[1]) == 1:
                    by_id[id(x[0])] = u
            index.append(u)
    return ImageBatch(
        pixel_values=np.concatenate(pix) if pix else np.zeros((0, d), np.float32),
        image_grid_thw=np.concatenate(grids) if grids else np.zeros((0, 3), np.int32),
        images_per_sample=np.asarray([0 if x is None else len(x[1]) for x in per_sample], np.int32),
        image_index=np.asarray(index, np.int32),
    )
