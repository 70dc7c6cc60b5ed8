"""A chat prompt's images, from the parts a caller sent to what the sequence carries: each image decoded and
prepared as the model's processor does (vision/), its placeholder tokens expanded, its M-RoPE positions.

Image parts, in any message's content list (OpenAI's, Responses', Anthropic's and the Python API's forms):

    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}   {"type": "input_image", ...}
    {"type": "image", "image": <bytes | path | PIL image | data URL | ImageData>}

A model that reads text only gets a one-line note in each image's place (or, under `images="refuse"`, the
request is refused), so one screenshot never ends a session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tinymlx.core.config import EngineConfig
from tinymlx.core.images import ImageData, ProcessedImage
from tinymlx.vision.image_input import ImageError, ImageLimits, decode_image

IMAGE_PART_TYPES = ("image", "image_url", "input_image")
IMAGE_NOTE = "[an image was omitted here: this model reads text only]"


class ImageIntake:
    def __init__(self, sees_images: bool, processor: Any, config: EngineConfig):
        """`processor`: the checkpoint's image processor (vision/processors.py), None for a text model."""
        self.processor, self.config = processor, config
        self.sees_images = sees_images and processor is not None
        self.num_omitted_images = 0  # images replaced by the note

    def split(self, messages: list[dict]) -> tuple[list[dict], list[ProcessedImage]]:
        """The messages as the chat template reads them (each image a {"type": "image"} part, or the note for a
        text model) and each image prepared, in order. ValueError (ImageError) names the part at fault."""
        rendered, sources = [], []
        for m, message in enumerate(messages):
            content = message.get("content")
            if not isinstance(content, list) or not any(_is_image(part) for part in content):
                rendered.append(message)
                continue
            parts = []
            for p, part in enumerate(content):
                if not _is_image(part):
                    parts.append(part)
                    continue
                where = f"messages[{m}].content[{p}]"
                if not self.sees_images:
                    if self.config.images == "refuse":
                        raise ImageError(f"{where}: this model reads text only and cannot take images")
                    self.num_omitted_images += 1
                    parts.append({"type": "text", "text": IMAGE_NOTE})
                    continue
                source = _source(part, where)
                sources.append((source, source.where if isinstance(source, ImageData) else where))
                parts.append({"type": "image"})
            rendered.append({**message, "content": parts if self.sees_images else _joined(parts)})
        return rendered, self.prepare(sources)

    def num_tokens(self, source: Any, where: str = "image") -> int:
        """The prompt tokens an image will take (0 for a text model, whose images become a note); an
        ImageError for an image the engine would refuse."""
        picture = decode_image(source, ImageLimits(max_bytes=self.config.max_image_bytes), where)
        if not self.sees_images:
            return 0
        return self.processor.num_tokens_for(picture.height, picture.width, max_pixels=self.config.max_image_pixels)

    def prepare(self, sources: list[tuple[Any, str]]) -> list[ProcessedImage]:
        """Each image decoded (within the limits) and processed, capped at max_image_pixels."""
        if len(sources) > self.config.max_images_per_request:
            raise ImageError(f"{sources[-1][1]}: {len(sources)} images in one request; at most "
                             f"{self.config.max_images_per_request} (--max-images-per-request)")
        limits, total, images = ImageLimits(max_bytes=self.config.max_image_bytes), 0, []
        for source, where in sources:
            total += _num_bytes(source)
            if total > self.config.max_image_bytes:
                raise ImageError(f"{where}: the request's images exceed {self.config.max_image_bytes} bytes "
                                 "(--max-image-bytes)")
            images.append(self.processor(decode_image(source, limits, where), max_pixels=self.config.max_image_pixels))
        return images


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def _source(part: dict, where: str) -> Any:
    """What an image part points at: bytes, a path, a PIL image or a data URL."""
    value = part.get(part["type"])
    if isinstance(value, dict):  # {"image_url": {"url": ...}}
        value = value.get("url")
    if value is None:
        raise ImageError(f"{where}: an image part needs its image (\"{part['type']}\")")
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        raise ImageError(f"{where}: the Python API takes images as bytes, paths, PIL images or data URLs; "
                         "fetch the URL first (the server fetches http(s) URLs itself)")
    return value


def _num_bytes(source: Any) -> int:
    if isinstance(source, bytes | bytearray):
        return len(source)
    if isinstance(source, ImageData):
        return len(source.data)
    if isinstance(source, str) and source.startswith("data:"):
        return len(source) * 3 // 4
    if isinstance(source, str | Path) and Path(source).is_file():
        return Path(source).stat().st_size
    return 0  # a PIL image: already decoded


def _joined(parts: list[Any]) -> str:
    """A text model's content list as one string: text-only templates print content as it is."""
    return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in parts)
