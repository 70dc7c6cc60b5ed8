"""The steps every family's image processor shares, written as Hugging Face's PIL backend computes them
(same dtypes, same order of float operations), so pixel values match theirs to the bit; and the reading
of a checkpoint's image-processor settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)


def read_processor_settings(model_dir: str | Path) -> dict[str, Any]:
    """The image processor's settings, where `from_pretrained` looks: processor_config.json's
    "image_processor" entry first, then preprocessor_config.json."""
    model_dir = Path(model_dir)
    nested = model_dir / "processor_config.json"
    if nested.is_file():
        settings = json.loads(nested.read_text()).get("image_processor")
        if isinstance(settings, dict):
            return settings
    flat = model_dir / "preprocessor_config.json"
    if flat.is_file():
        return json.loads(flat.read_text())
    raise FileNotFoundError(f"{model_dir}: no preprocessor_config.json (nor an image_processor entry in "
                            "processor_config.json): the image processor's settings are unknown")


def setting(settings: dict[str, Any], key: str, default: Any) -> Any:
    """A setting, or the default where it is absent or null (as Hugging Face fills unset attributes)."""
    value = settings.get(key)
    return default if value is None else value


def shared_settings(settings: dict[str, Any], defaults: Any) -> dict[str, Any]:
    """The resize, rescale and normalize settings every processor reads, by field name; `defaults`: the
    processor class, whose fields' defaults fill what the checkpoint leaves out."""
    return dict(
        do_resize=bool(setting(settings, "do_resize", defaults.do_resize)),
        resample=resample_filter(settings.get("resample"), defaults.resample),
        do_rescale=bool(setting(settings, "do_rescale", defaults.do_rescale)),
        rescale_factor=float(setting(settings, "rescale_factor", defaults.rescale_factor)),
        do_normalize=bool(setting(settings, "do_normalize", defaults.do_normalize)),
        image_mean=channel_triple(setting(settings, "image_mean", defaults.image_mean)),
        image_std=channel_triple(setting(settings, "image_std", defaults.image_std)),
    )


def channel_triple(value: float | list[float] | tuple[float, ...]) -> tuple[float, ...]:
    """A per-channel mean or std; a single number stands for every channel."""
    return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else (float(value),) * 3


def resample_filter(value: int | str | None, default: Image.Resampling) -> Image.Resampling:
    """A config's `resample` (PIL's number, or its name) as a Pillow filter."""
    if value is None:
        return default
    return Image.Resampling[value.upper()] if isinstance(value, str) else Image.Resampling(int(value))


def resized(picture: Image.Image, height: int, width: int, resample: Image.Resampling) -> Image.Image:
    """Pillow's resize on the uint8 picture, as the PIL backend does (no reducing gap)."""
    if picture.size == (width, height):
        return picture
    return picture.resize((width, height), resample=resample)


def channels_first(picture: Image.Image) -> np.ndarray:
    """[C, H, W] uint8: the layout Hugging Face's processors work in."""
    return np.ascontiguousarray(np.asarray(picture).transpose(2, 0, 1))


def rescale_and_normalize(pixels: np.ndarray, do_rescale: bool, rescale_factor: float, do_normalize: bool,
                          mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """[C, H, W] -> float32. Rescale multiplies in float64 and casts down; normalize works in float32:
    exactly the two steps of `transformers.image_transforms.rescale` / `normalize`."""
    if do_rescale:
        pixels = (pixels.astype(np.float64) * rescale_factor).astype(np.float32)
    if do_normalize:
        if not np.issubdtype(pixels.dtype, np.floating):
            pixels = pixels.astype(np.float32)
        if len(mean) != pixels.shape[0] or len(std) != pixels.shape[0]:
            raise ValueError(f"image_mean/std have {len(mean)}/{len(std)} values for {pixels.shape[0]} channels")
        mean_array = np.array(mean, dtype=pixels.dtype)[:, None, None]
        std_array = np.array(std, dtype=pixels.dtype)[:, None, None]
        pixels = (pixels - mean_array) / std_array
    return pixels.astype(np.float32, copy=False)
