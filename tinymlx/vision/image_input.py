"""What a user sends (bytes, a path, a `data:` URL, a PIL image, `ImageData`) -> one decoded RGB picture.

An engine opens untrusted images, so this is where they are refused: too many bytes, too many pixels
(judged from the header, before a decompression bomb's pixels exist), a format outside a short list, and
corrupt or truncated data. Every refusal is an `ImageError` naming the request part it came from."""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from tinymlx.core.images import ImageData

ImageSource = bytes | bytearray | memoryview | str | os.PathLike | Image.Image | ImageData


class ImageError(ValueError):
    """An image the engine will not take; the message says where it came from and why."""


@dataclass(frozen=True)
class ImageLimits:
    """What one image may cost before it is decoded. MPO is how Pillow names a phone camera's JPEG."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000
    formats: frozenset[str] = frozenset({"PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP"})


def decode_image(source: ImageSource, limits: ImageLimits | None = None, where: str | None = None) -> Image.Image:
    """The picture in `source`, decoded and in RGB (only the first frame of an animation). `where` names
    the request part in errors; None: the `ImageData`'s own, else "image". EXIF orientation is left
    alone, as Hugging Face's processors leave it, so the pixels match theirs."""
    limits = limits or ImageLimits()
    if isinstance(source, ImageData):
        where = where or source.where
        source = source.data
    where = where or "image"
    if isinstance(source, Image.Image):
        _check_pixels(source.size, limits, where)
        _load(source, where)
        return to_rgb(source)
    return _decode(_read_bytes(source, limits, where), limits, where)


def to_rgb(picture: Image.Image) -> Image.Image:
    """RGB as Hugging Face's `convert_to_rgb` makes it: transparency composited over white."""
    has_alpha = "A" in picture.getbands() or picture.info.get("transparency") is not None
    if has_alpha:
        rgba = picture.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return picture if picture.mode == "RGB" else picture.convert("RGB")


def _read_bytes(source: ImageSource, limits: ImageLimits, where: str) -> bytes:
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    elif isinstance(source, str) and source[:5].lower() == "data:":
        data = data_url_bytes(source, limits, where)
    elif isinstance(source, str) and source[:8].lower().startswith(("http://", "https://")):
        raise ImageError(f"{where}: remote image URLs are not fetched; send the bytes or a data: URL")
    elif isinstance(source, (str, os.PathLike)):
        data = _file_bytes(Path(source), limits, where)
    else:
        raise ImageError(f"{where}: cannot read an image from a {type(source).__name__}")
    if len(data) > limits.max_bytes:
        raise ImageError(f"{where}: the image has {len(data)} bytes, over the limit of {limits.max_bytes}")
    if not data:
        raise ImageError(f"{where}: the image is empty")
    return data


def data_url_bytes(url: str, limits: ImageLimits, where: str) -> bytes:
    """The bytes of a base64 `data:image/...` URL (the server's wire formats read theirs with this too)."""
    header, comma, payload = url[5:].partition(",")
    params = [param.strip().lower() for param in header.split(";")]
    if not comma:
        raise ImageError(f"{where}: bad data URL: no ',' before the data")
    if "base64" not in params[1:]:
        raise ImageError(f"{where}: bad data URL: the data must be base64 (data:image/png;base64,...)")
    if params[0] and not params[0].startswith("image/"):
        raise ImageError(f"{where}: bad data URL: media type {params[0]!r} is not an image")
    payload = "".join(payload.split())
    if len(payload) * 3 // 4 > limits.max_bytes:  # refuse before decoding a huge string
        raise ImageError(f"{where}: the image has about {len(payload) * 3 // 4} bytes, "
                         f"over the limit of {limits.max_bytes}")
    try:
        return base64.b64decode(payload + "=" * (-len(payload) % 4), validate=True)
    except (binascii.Error, ValueError) as error:
        raise ImageError(f"{where}: bad data URL: the base64 data does not decode ({error})") from None


def _file_bytes(path: Path, limits: ImageLimits, where: str) -> bytes:
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise ImageError(f"{where}: {str(path)!r} is not a file")
        if size > limits.max_bytes:
            raise ImageError(f"{where}: the image has {size} bytes, over the limit of {limits.max_bytes}")
        return path.read_bytes()
    except FileNotFoundError:
        raise ImageError(f"{where}: image file not found: {str(path)!r}") from None
    except OSError as error:
        raise ImageError(f"{where}: cannot read image file {str(path)!r} ({error.strerror})") from None


def _decode(data: bytes, limits: ImageLimits, where: str) -> Image.Image:
    try:
        picture = Image.open(io.BytesIO(data), formats=_openers(limits))
    except Image.DecompressionBombError as error:
        raise ImageError(f"{where}: the image has too many pixels ({error})") from None
    except UnidentifiedImageError:
        raise ImageError(f"{where}: {_unreadable(data, limits)}") from None
    except Exception as error:  # any parser failure on untrusted bytes is the sender's data, not our bug
        raise ImageError(f"{where}: the image data is corrupt ({error})") from None
    with picture:
        if picture.format not in limits.formats:
            raise ImageError(f"{where}: unsupported image format {picture.format} "
                             f"(allowed: {', '.join(sorted(limits.formats))})")
        _check_pixels(picture.size, limits, where)
        _load(picture, where)
        rgb = to_rgb(picture)
        return rgb.copy() if rgb is picture else rgb  # closing the file frees the picture's own pixels


def _openers(limits: ImageLimits) -> list[str]:
    """Pillow's openers for the allowed formats: an MPO file opens through the JPEG one."""
    return sorted(fmt.upper() for fmt in limits.formats if fmt.upper() != "MPO")


def _check_pixels(size: tuple[int, int], limits: ImageLimits, where: str) -> None:
    width, height = size
    if width * height > limits.max_pixels:
        raise ImageError(f"{where}: the image has too many pixels: {width}x{height} = {width * height}, "
                         f"over the limit of {limits.max_pixels}")
    if width < 1 or height < 1:
        raise ImageError(f"{where}: the image is empty ({width}x{height} pixels)")


def _load(picture: Image.Image, where: str) -> None:
    """Decode the pixels now, so a truncated file fails here (ImageFile.LOAD_TRUNCATED_IMAGES stays off)."""
    try:
        picture.load()
    except Exception as error:
        raise ImageError(f"{where}: the image data is corrupt or truncated ({error})") from None


def _unreadable(data: bytes, limits: ImageLimits) -> str:
    """Why Pillow found no allowed format: name the format when Pillow knows it, else call it corrupt."""
    try:
        with Image.open(io.BytesIO(data)) as other:
            found = other.format
    except Exception:
        found = None
    if found and found not in limits.formats:
        return f"unsupported image format {found} (allowed: {', '.join(sorted(limits.formats))})"
    return "the data is not an image of a known format, or it is corrupt"
