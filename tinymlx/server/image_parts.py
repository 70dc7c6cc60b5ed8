"""An image part of any wire format -> ImageData: a `data:` URL (or Anthropic's base64 source) decoded here,
an http(s) URL left for image_fetch.py to fetch before the prompt is made. Each error is a 400 naming the part.

    OpenAI chat  {"type": "image_url", "image_url": {"url": ...} | ...}     image_of_url(url, where)
    Responses    {"type": "input_image", "image_url": ...}                   image_of_url(url, where)
    Anthropic    {"type": "image", "source": {"type": "base64", ...}}        image_of_base64(data, media_type, where)
                 {"type": "image", "source": {"type": "url", "url": ...}}    image_of_url(url, where)
"""

from __future__ import annotations

import sys
from typing import Any

from tinymlx.core.images import ImageData
from tinymlx.turns.api_error import APIError
from tinymlx.vision.image_input import ImageError, ImageLimits, data_url_bytes

# The body already holds these bytes as base64; the engine holds a request's images to --max-image-bytes.
_INLINE = ImageLimits(max_bytes=sys.maxsize)


def image_of_url(url: Any, where: str) -> ImageData:
    if not isinstance(url, str):
        raise APIError(400, f"{where}: an image's url must be a string, got {type(url).__name__}", where,
                       "invalid_image")
    if url[:5].lower() == "data:":
        try:
            return ImageData(data_url_bytes(url, _INLINE, where), where)
        except ImageError as error:
            raise APIError(400, str(error), where, "invalid_image") from None
    if url[:8].lower().startswith(("http://", "https://")):
        return ImageData(b"", where, url=url)
    shown = url if len(url) <= 40 else url[:37] + "..."
    raise APIError(400, f"{where}: an image's url must be a data: URL (data:image/png;base64,...) or an http(s) "
                        f"URL, got {shown!r}", where, "invalid_image")


def image_of_base64(data: str, media_type: str, where: str) -> ImageData:
    return image_of_url(f"data:{media_type};base64,{data}", where)
