"""Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5's image processor: Hugging Face's `Qwen2VLImageProcessorPil`
(transformers 5.25) step for step, so the vision tower sees the pixels it was trained on.

    picture -> smart_resize (sides multiples of patch * merge, area within [min, max] pixels)
            -> rescale, normalize -> patches [t*h*w, C * T * patch * patch] in HF's order"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from tinymlx.core.images import ProcessedImage
from tinymlx.vision.image_input import ImageError, to_rgb
from tinymlx.vision.pixels import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    channels_first,
    read_processor_settings,
    rescale_and_normalize,
    resized,
    setting,
    shared_settings,
)

MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor`, scaled into [min_pixels, max_pixels] keeping the
    aspect ratio: HF's `smart_resize`, with its float operations in its order (the grid must agree)."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(f"the image's aspect ratio {max(height, width) / min(height, width):.0f}:1 "
                         f"({width}x{height}) is over {MAX_ASPECT_RATIO}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class QwenImageProcessor:
    """The settings of a Qwen checkpoint's preprocessor_config.json, HF's class defaults where absent.

    `__call__` returns `pixel_values` [grid_h * grid_w, 3 * temporal_patch_size * patch_size**2] float32:
    patches ordered by merge window (row-major), then row-major inside the window; each patch's values
    ordered (channel, time, y, x), the one frame repeated over time. `grid_thw` = (1, grid_h, grid_w);
    `num_tokens` = grid_h * grid_w // merge_size**2."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    do_resize: bool = True
    resample: Image.Resampling = Image.Resampling.BICUBIC
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD

    @classmethod
    def from_config(cls, settings: dict[str, Any]) -> QwenImageProcessor:
        """Read as HF's __init__ does: `size` {shortest_edge, longest_edge} bounds the area, and the older
        top-level `min_pixels` / `max_pixels` override it where present."""
        size = settings.get("size") if isinstance(settings.get("size"), dict) else {}
        min_pixels = setting(size, "shortest_edge", setting(size, "min_pixels", cls.min_pixels))
        max_pixels = setting(size, "longest_edge", setting(size, "max_pixels", cls.max_pixels))
        return cls(
            patch_size=int(setting(settings, "patch_size", cls.patch_size)),
            merge_size=int(setting(settings, "merge_size", cls.merge_size)),
            temporal_patch_size=int(setting(settings, "temporal_patch_size", cls.temporal_patch_size)),
            min_pixels=int(setting(settings, "min_pixels", min_pixels)),
            max_pixels=int(setting(settings, "max_pixels", max_pixels)),
            **shared_settings(settings, cls),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> QwenImageProcessor:
        return cls.from_config(read_processor_settings(model_dir))

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merge window of patches."""
        return self.patch_size * self.merge_size

    def resized_size(self, height: int, width: int, max_pixels: int | None = None) -> tuple[int, int]:
        """(height, width) the picture is resized to; `max_pixels` caps the checkpoint's own bound (and its
        floor, so a small picture is not enlarged past the cap)."""
        if not self.do_resize:
            return height, width
        cap = self.max_pixels if max_pixels is None else min(self.max_pixels, max_pixels)
        return smart_resize(height, width, self.factor, min(self.min_pixels, cap), cap)

    def num_tokens_for(self, height: int, width: int, max_pixels: int | None = None) -> int:
        """The placeholder tokens a height x width picture takes, without processing it."""
        resized_height, resized_width = self.resized_size(height, width, max_pixels)
        return (resized_height // self.patch_size) * (resized_width // self.patch_size) // self.merge_size**2

    def __call__(self, image: Image.Image, max_pixels: int | None = None) -> ProcessedImage:
        """One picture as the tower reads it. `max_pixels` (an engine cap below the checkpoint's) still
        gives a grid of whole merge windows: at least one window whatever the cap."""
        picture = to_rgb(image)
        height, width = self.resized_size(picture.height, picture.width, max_pixels)
        if height % self.factor or width % self.factor:
            raise ImageError(f"a {width}x{height} image is not in whole {self.factor}-pixel merge windows "
                             "and the checkpoint's processor does not resize")
        pixels = channels_first(resized(picture, height, width, self.resample))
        pixels = rescale_and_normalize(pixels, self.do_rescale, self.rescale_factor, self.do_normalize,
                                       self.image_mean, self.image_std)
        patches, grid_h, grid_w = self._patchify(pixels)
        grid_thw = (1, grid_h, grid_w)
        return ProcessedImage(patches, grid_thw, grid_h * grid_w // self.merge_size**2)

    def _patchify(self, pixels: np.ndarray) -> tuple[np.ndarray, int, int]:
        """[C, H, W] -> [grid_h * grid_w, C * T * patch * patch], HF's `patchify` (a still image is one
        frame repeated over the temporal patch)."""
        channels, height, width = pixels.shape
        patch, merge, temporal = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // patch, width // patch
        patches = pixels.reshape(channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
        patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # (gh, gw, mh, mw, C, ph, pw)
        patches = np.broadcast_to(patches[:, :, :, :, :, None],
                                  (*patches.shape[:5], temporal, *patches.shape[5:]))
        flat = patches.reshape(grid_h * grid_w, channels * temporal * patch * patch)
        return np.ascontiguousarray(flat, dtype=np.float32), grid_h, grid_w
