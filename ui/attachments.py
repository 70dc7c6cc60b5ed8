"""Images attached to a message: read from a file, measured by the engine (pixel size, prompt tokens), and
the paths a paste or a typed line names (terminals paste a dragged file as its path)."""

from __future__ import annotations

import dataclasses
import io
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

from PIL import Image

from tinymlx.vision.image_input import ImageError

if TYPE_CHECKING:
    from tinymlx.engine.image_intake import ImageIntake

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp"})
_MAX_PASTED_PATHS_CHARS = 8192  # a longer paste is text, not dragged files: do not stat it


@dataclass(frozen=True)
class Attachment:
    """An image on a user turn. `data`: the file's bytes as read, sent again every later turn, so the
    prefix cache sees the same image. `num_tokens`: the prompt tokens it takes with the model loaded now
    (0: the model reads text only and gets a note instead; None: not measured, the engine refused it)."""

    name: str
    data: bytes
    width: int
    height: int
    num_tokens: int | None = None


def measured(name: str, data: bytes, images: ImageIntake) -> Attachment:
    """The image measured by the engine; ImageError (a ValueError) says why the engine would refuse it."""
    if not images.sees_images and images.config.images == "refuse":
        raise ImageError(f"{name}: this model reads text only, and the engine refuses images (--images refuse)")
    num_tokens = images.num_tokens(data, name)  # decodes it: a corrupt or oversized image fails here
    with Image.open(io.BytesIO(data)) as picture:
        width, height = picture.size
    return Attachment(name, data, width, height, num_tokens)


def read_image(path: Path, images: ImageIntake) -> Attachment:
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise ImageError(f"{path}: not a file")
        if size > images.config.max_image_bytes:  # refused before reading a huge file
            raise ImageError(f"{path.name}: {size} bytes, over the engine's limit of {images.config.max_image_bytes} "
                             "(--max-image-bytes)")
        data = path.read_bytes()
    except FileNotFoundError:
        raise ImageError(f"{path}: no such file") from None
    except OSError as error:
        raise ImageError(f"{path}: cannot read it ({error.strerror})") from None
    return measured(path.name, data, images)


def read_images(paths: list[Path], images: ImageIntake) -> tuple[list[Attachment], list[str]]:
    """Each file read and measured: the attachments, and for each file refused, why."""
    attachments, errors = [], []
    for path in paths:
        try:
            attachments.append(read_image(path, images))
        except ValueError as error:
            errors.append(str(error))
        except Exception as error:  # noqa: BLE001 - an untrusted file the checks missed refuses that file, not the app
            errors.append(f"{path.name}: cannot read it as an image ({type(error).__name__}: {error})")
    return attachments, errors


def remeasured(attachment: Attachment, images: ImageIntake) -> Attachment:
    """A stored image's token count under the model loaded now (which may not be the one it was sent to)."""
    try:
        return dataclasses.replace(attachment, num_tokens=measured(attachment.name, attachment.data, images).num_tokens)
    except ValueError:
        return dataclasses.replace(attachment, num_tokens=None)


def over_limit(conversation: list[Attachment], new: Attachment, images: ImageIntake) -> str | None:
    """Why `new` cannot join: each turn sends the whole conversation with its images, so the engine's
    per-request limits count every image in it. A text-only model gets notes, which have no limit."""
    if not images.sees_images:
        return None
    limit = images.config.max_images_per_request
    if len(conversation) + 1 > limit:
        return (f"{new.name}: not attached: the engine takes at most {limit} images per request "
                "(--max-images-per-request), and each turn sends every image of the conversation")
    total = sum(len(image.data) for image in conversation) + len(new.data)
    if total > images.config.max_image_bytes:
        return (f"{new.name}: not attached: the conversation's images would take {total} bytes, over the engine's "
                f"{images.config.max_image_bytes} per request (--max-image-bytes)")
    return None


def chip_text(attachment: Attachment, sees_images: bool) -> str:
    if attachment.num_tokens is None:
        cost = "? tokens (this engine refuses it)"
    elif not sees_images:
        cost = "sent as a note (this model reads text only)"
    else:
        cost = f"{attachment.num_tokens} tokens"
    # A file name is untrusted text: no control character (ESC above all) reaches the terminal.
    name = "".join(c if c.isprintable() else "\N{REPLACEMENT CHARACTER}" for c in attachment.name)
    return f"▣ {name} · {attachment.width}×{attachment.height} · {cost}"


def paths_in(text: str) -> list[Path]:
    """The files a line names: one path (quoted, with escaped spaces, as a file:// URL, with ~) or several
    separated by spaces, as terminals paste several dragged files. Whether they exist is not checked."""
    text = text.strip()
    whole = _as_path(_unquoted(text))
    if _is_file(whole):
        return [whole]  # an unquoted path with spaces in it
    try:
        words = shlex.split(text)  # quotes and backslash escapes, as a shell reads them
    except ValueError:
        return [whole]
    paths = [_as_path(word) for word in words]
    return paths if paths and all(_is_file(path) for path in paths) else [whole]


def pasted_image_paths(text: str) -> list[Path]:
    """The image files a paste names, or [] when it is anything else (then it is pasted as text)."""
    if not text.strip() or len(text) > _MAX_PASTED_PATHS_CHARS:
        return []
    paths = paths_in(text)
    return paths if all(_is_file(path) and path.suffix.lower() in IMAGE_SUFFIXES for path in paths) else []


def _unquoted(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1]
    return text


def _as_path(word: str) -> Path:
    if word.startswith("file://"):
        word = unquote(urlparse(word).path)
    return Path(word).expanduser()


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a name too long, a NUL byte: pasted text, not a file
        return False
