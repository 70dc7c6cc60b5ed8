"""Gemma 3's and Gemma 4's image processors, as transformers 5.25's PIL backend computes them
(`Gemma3ImageProcessorPil`, `Gemma4ImageProcessorPil`), so their towers see the pixels they were trained on.

    Gemma 3: picture -> fixed size (896 x 896 in the checkpoints) -> rescale, normalize -> [C, H, W]
    Gemma 4: picture -> aspect kept, sides multiples of pooling * patch, within a soft-token budget
             -> rescale (no normalize by default) -> patches [rows * cols, patch * patch * C]"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from tinymlx.core.images import ProcessedImage
from tinymlx.vision.image_input import ImageError, to_rgb
from tinymlx.vision.pixels import (
    HALF,
    channels_first,
    read_processor_settings,
    rescale_and_normalize,
    resized,
    setting,
    shared_settings,
)

GEMMA4_SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)


@dataclass(frozen=True)
class Gemma3ImageProcessor:
    """SigLIP-style: every picture resized to one size, whatever its aspect. `pixel_values` [3, H, W]
    float32; `grid_thw` None; `num_tokens` the model's `mm_tokens_per_image`. Pan-and-scan (off in HF's
    Gemma3Processor by default) is not done: one picture is one crop."""

    height: int = 224
    width: int = 224
    num_tokens: int = 256
    do_resize: bool = True
    resample: Image.Resampling = Image.Resampling.BILINEAR
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = HALF
    image_std: tuple[float, ...] = HALF

    @classmethod
    def from_config(cls, settings: dict[str, Any], model_config: dict[str, Any] | None = None
                    ) -> Gemma3ImageProcessor:
        """`settings`: preprocessor_config.json; `model_config`: config.json, for `mm_tokens_per_image`."""
        size = setting(settings, "size", {"height": cls.height, "width": cls.width})
        if isinstance(size, int):
            size = {"height": size, "width": size}
        if not isinstance(size, dict) or "height" not in size or "width" not in size:
            raise ValueError(f"Gemma 3's image size must be {{height, width}}, got {size!r}")
        num_tokens = setting(model_config or {}, "mm_tokens_per_image",
                             setting(settings, "image_seq_length", cls.num_tokens))
        return cls(
            height=int(size["height"]),
            width=int(size["width"]),
            num_tokens=int(num_tokens),
            **shared_settings(settings, cls),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Gemma3ImageProcessor:
        config_path = Path(model_dir) / "config.json"
        model_config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        return cls.from_config(read_processor_settings(model_dir), model_config)

    def num_tokens_for(self, height: int, width: int, max_pixels: int | None = None) -> int:
        return self.num_tokens

    def __call__(self, image: Image.Image, max_pixels: int | None = None) -> ProcessedImage:
        """One picture as the tower reads it; `max_pixels` does not apply to a fixed-size tower."""
        picture = to_rgb(image)
        if self.do_resize:
            picture = resized(picture, self.height, self.width, self.resample)
        pixels = rescale_and_normalize(channels_first(picture), self.do_rescale, self.rescale_factor,
                                       self.do_normalize, self.image_mean, self.image_std)
        return ProcessedImage(pixels, None, self.num_tokens)


@dataclass(frozen=True)
class Gemma4ImageProcessor:
    """Variable resolution: the picture keeps its aspect, resized to the largest sides that are multiples
    of pooling_kernel_size * patch_size and give at most max_soft_tokens * pooling_kernel_size**2 patches.

    `pixel_values` [rows * cols, patch_size**2 * 3] float32: patches row-major over the patch grid, each
    patch's values ordered (y, x, channel), HF's `convert_image_to_patches`. HF pads these to the budget
    (zero rows, position (-1, -1)) to batch images; we keep only the real rows, since the tower masks the
    padding. `grid_thw` = (1, rows, cols): `gemma4_position_ids` rebuilds HF's `image_position_ids` from
    it. `num_tokens` = rows * cols // pooling_kernel_size**2, the soft tokens (without begin/end)."""

    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    do_resize: bool = True
    resample: Image.Resampling = Image.Resampling.BICUBIC
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = False
    image_mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    image_std: tuple[float, ...] = (1.0, 1.0, 1.0)

    def __post_init__(self) -> None:
        if self.max_soft_tokens not in GEMMA4_SOFT_TOKEN_BUDGETS:
            raise ValueError(f"max_soft_tokens must be one of {GEMMA4_SOFT_TOKEN_BUDGETS}, "
                             f"got {self.max_soft_tokens}")

    @classmethod
    def from_config(cls, settings: dict[str, Any]) -> Gemma4ImageProcessor:
        return cls(
            patch_size=int(setting(settings, "patch_size", cls.patch_size)),
            max_soft_tokens=int(setting(settings, "max_soft_tokens", cls.max_soft_tokens)),
            pooling_kernel_size=int(setting(settings, "pooling_kernel_size", cls.pooling_kernel_size)),
            **shared_settings(settings, cls),
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Gemma4ImageProcessor:
        return cls.from_config(read_processor_settings(model_dir))

    def soft_token_budget(self, max_pixels: int | None = None) -> int:
        """The checkpoint's budget, or under a pixel cap the largest of HF's budgets whose patches fit
        in it (the smallest budget if none does)."""
        if max_pixels is None:
            return self.max_soft_tokens
        pixels_per_token = (self.pooling_kernel_size * self.patch_size) ** 2
        fitting = [budget for budget in GEMMA4_SOFT_TOKEN_BUDGETS
                   if budget <= self.max_soft_tokens and budget * pixels_per_token <= max_pixels]
        return max(fitting, default=GEMMA4_SOFT_TOKEN_BUDGETS[0])

    def resized_size(self, height: int, width: int, max_pixels: int | None = None) -> tuple[int, int]:
        if not self.do_resize:
            return height, width
        max_patches = self.soft_token_budget(max_pixels) * self.pooling_kernel_size**2
        return _aspect_preserving_size(height, width, self.patch_size, max_patches, self.pooling_kernel_size)

    def num_tokens_for(self, height: int, width: int, max_pixels: int | None = None) -> int:
        resized_height, resized_width = self.resized_size(height, width, max_pixels)
        num_patches = (resized_height // self.patch_size) * (resized_width // self.patch_size)
        return num_patches // self.pooling_kernel_size**2

    def __call__(self, image: Image.Image, max_pixels: int | None = None) -> ProcessedImage:
        """One picture as the tower reads it; `max_pixels` lowers the soft-token budget to fit."""
        picture = to_rgb(image)
        height, width = self.resized_size(picture.height, picture.width, max_pixels)
        if height % self.patch_size or width % self.patch_size:
            raise ImageError(f"a {width}x{height} image is not in whole {self.patch_size}-pixel patches "
                             "and the checkpoint's processor does not resize")
        pixels = channels_first(resized(picture, height, width, self.resample))
        pixels = rescale_and_normalize(pixels, self.do_rescale, self.rescale_factor, self.do_normalize,
                                       self.image_mean, self.image_std)
        rows, cols = height // self.patch_size, width // self.patch_size
        patches = pixels.reshape(3, rows, self.patch_size, cols, self.patch_size).transpose(1, 3, 2, 4, 0)
        patches = np.ascontiguousarray(patches.reshape(rows * cols, -1), dtype=np.float32)
        return ProcessedImage(patches, (1, rows, cols), rows * cols // self.pooling_kernel_size**2)


def gemma4_position_ids(grid_thw: tuple[int, int, int]) -> np.ndarray:
    """[rows * cols, 2] int64: each patch's (x, y) in the patch grid, HF's `image_position_ids` minus
    its padding."""
    _, rows, cols = grid_thw
    grid_x, grid_y = np.meshgrid(np.arange(cols), np.arange(rows), indexing="xy")
    return np.stack([grid_x, grid_y], axis=-1).reshape(rows * cols, 2).astype(np.int64)


def _aspect_preserving_size(height: int, width: int, patch_size: int, max_patches: int,
                            pooling_kernel_size: int) -> tuple[int, int]:
    """HF's `get_aspect_ratio_preserving_size`: the largest sides in multiples of pooling * patch whose
    patches fit the budget; a side that rounds to nothing gets one multiple and the other keeps the ratio."""
    target_px = max_patches * patch_size**2
    factor = math.sqrt(target_px / (height * width))
    side_mult = pooling_kernel_size * patch_size
    target_height = int(math.floor(factor * height / side_mult)) * side_mult
    target_width = int(math.floor(factor * width / side_mult)) * side_mult
    if target_height == 0 and target_width == 0:
        raise ImageError(f"a {width}x{height} image cannot be resized into {side_mult}-pixel pooling cells")
    max_side_length = (max_patches // pooling_kernel_size**2) * side_mult
    if target_height == 0:
        target_height = side_mult
        target_width = min(int(math.floor(width / height)) * side_mult, max_side_length)
    elif target_width == 0:
        target_width = side_mult
        target_height = min(int(math.floor(height / width)) * side_mult, max_side_length)
    if target_height * target_width > target_px:
        raise ImageError(f"a {width}x{height} image does not fit in {max_patches} patches of {patch_size} "
                         "pixels at any size")
    return target_height, target_width
