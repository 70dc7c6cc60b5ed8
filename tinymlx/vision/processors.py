"""config.json's model_type -> the image processor its vision tower was trained with (None: no images)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from PIL import Image

from tinymlx.core.images import ProcessedImage
from tinymlx.vision.gemma_processor import Gemma3ImageProcessor, Gemma4ImageProcessor
from tinymlx.vision.pixels import read_processor_settings
from tinymlx.vision.qwen_processor import QwenImageProcessor

QWEN_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"})


class ImageProcessor(Protocol):
    """What every family's processor offers the engine."""

    def __call__(self, image: Image.Image, max_pixels: int | None = None) -> ProcessedImage: ...

    def num_tokens_for(self, height: int, width: int, max_pixels: int | None = None) -> int: ...


def image_processor_for(model_dir: str | Path, config: dict[str, Any]) -> ImageProcessor | None:
    """The processor for the checkpoint in `model_dir` whose config.json is `config`; None for a family
    without a vision tower (or a text-only checkpoint, e.g. model_type gemma3_text)."""
    model_type = config.get("model_type")
    if model_type in QWEN_MODEL_TYPES:
        return QwenImageProcessor.from_dir(model_dir)
    if model_type == "gemma3":
        return Gemma3ImageProcessor.from_config(read_processor_settings(model_dir), config)
    if model_type == "gemma4":
        return Gemma4ImageProcessor.from_dir(model_dir)
    return None
