"""Images as plain data between stages: what a face hands the engine (`ImageData`), what a family's
processor makes of it (`ProcessedImage`, vision/), and where it sits in a sequence (`ImageSpan`,
`PromptImages`): a span of placeholder tokens plus the image's content digest.

    bytes | path | PIL image | data URL  --vision/ decode + family processor-->  ProcessedImage
    prompt ids with one placeholder per image  --expand to num_tokens each-->  PromptImages(spans, rope)

Block hashes read `PromptImages.keys`: the token ids with each image's tokens replaced by values drawn
from its digest and offset, so the same image is a prefix hit and a different one with the same
placeholder tokens never is (vLLM's extra keys)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ImageData:
    """An image as a request sent it, still encoded (PNG, JPEG, WebP, ...); `where`: the request's part
    it came from, named in errors ("messages[1].content[0]"). `url`: an http(s) URL the server fetches
    into `data` before the prompt is made (server/image_fetch.py); "" once it holds the bytes."""

    data: bytes
    where: str = "image"
    url: str = ""


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One image as its family's vision tower reads it.

    `pixel_values`: float32, the tower's input (Qwen: [patches, C * T * patch * patch], patches ordered as
    Hugging Face's processor orders them; Gemma: [C, H, W]). `grid_thw`: Qwen's (t, h, w) in patches, None
    for fixed-size towers. `num_tokens`: the placeholder tokens it takes in the prompt. `digest`: a
    128-bit content hash of the pixels the tower reads (and their grid)."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int] | None
    num_tokens: int
    digest: int = field(default=0)

    def __post_init__(self) -> None:
        if not self.digest:
            object.__setattr__(self, "digest", pixel_digest(self.pixel_values, self.grid_thw))


def pixel_digest(pixel_values: np.ndarray, grid_thw: tuple[int, int, int] | None) -> int:
    data = np.ascontiguousarray(pixel_values, dtype=np.float32).tobytes()
    header = np.array([*(grid_thw or (0, 0, 0)), *pixel_values.shape], dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(header + data, digest_size=16).digest(), "little")


@dataclass(frozen=True, eq=False)
class ImageSpan:
    """An image's placeholder tokens in a prompt: token positions start .. start + length - 1."""

    start: int
    image: ProcessedImage

    @property
    def length(self) -> int:
        return self.image.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.image.num_tokens


def expand_placeholders(token_ids: list[int], images: list[ProcessedImage], placeholder: int, image_token: int,
                        before: list[int], after: list[int]) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """Each `placeholder` the chat template wrote, one per image in order, replaced by `before`, the image's
    num_tokens `image_token`s and `after` (what each family's processor writes); ValueError when the counts
    differ. Returns the expanded ids and each image's span of image tokens."""
    found = [i for i, token in enumerate(token_ids) if token == placeholder]
    if len(found) != len(images):
        raise ValueError(f"the prompt has {len(found)} image placeholder(s) for {len(images)} image(s)")
    expanded: list[int] = []
    spans, previous = [], 0
    for index, image in zip(found, images):
        expanded += token_ids[previous:index] + before
        spans.append(ImageSpan(len(expanded), image))
        expanded += [image_token] * image.num_tokens + after
        previous = index + 1
    return expanded + token_ids[previous:], tuple(spans)


@dataclass(frozen=True, eq=False)
class PromptImages:
    """The images of one prompt, in order, and the positions its multimodal RoPE rotates by.

    `rope_positions`: [3, prompt tokens] (temporal, height, width) for Qwen's M-RoPE, None for a family
    with plain positions. Past the prompt every token's three are its position + `rope_delta`.
    `whole_spans`: an image's tokens attend to each other both ways (Gemma), so each span is computed in
    one chunk: every key of the span exists when its first query runs."""

    spans: tuple[ImageSpan, ...]
    rope_positions: np.ndarray | None = None
    rope_delta: int = 0
    whole_spans: bool = False

    def chunk_end(self, start: int, end: int) -> int:
        """Where a chunk of tokens start .. end - 1 may end: with whole spans, never inside one. It is cut
        back to the span's start, or to `start` (nothing this step) when it begins inside the span: the rest
        of the span then waits for a step with room for all of it."""
        if not self.whole_spans:
            return end
        for span in self.spans:
            if span.start < end < span.end:
                return span.start if span.start > start else start
        return end

    def whole_span_bounds(self, positions: np.ndarray) -> np.ndarray:
        """[..., 2]: (start, end) of the span each position lies in, (-1, -1) outside every span."""
        bounds = np.full((*positions.shape, 2), -1, dtype=np.int32)
        for span in self.spans:
            inside = (positions >= span.start) & (positions < span.end)
            bounds[inside] = (span.start, span.end)
        return bounds

    @property
    def longest_span(self) -> int:
        return max((span.length for span in self.spans), default=0)

    def overlapping(self, start: int, end: int) -> list[tuple[ImageSpan, int, int]]:
        """(span, first, last + 1) token offsets into each span that tokens start .. end - 1 cover."""
        return [(span, max(start, span.start) - span.start, min(end, span.end) - span.start)
                for span in self.spans if span.start < end and start < span.end]

    def rope(self, start: int, end: int) -> np.ndarray:
        """[3, end - start] M-RoPE positions of tokens start .. end - 1 (the prompt's, then position + delta)."""
        assert self.rope_positions is not None
        num_prompt = self.rope_positions.shape[1]
        inside = self.rope_positions[:, start:min(end, num_prompt)]
        if end <= num_prompt:
            return inside
        after = np.arange(max(start, num_prompt), end, dtype=inside.dtype) + self.rope_delta
        return np.concatenate([inside, np.broadcast_to(after, (3, after.size))], axis=1)

    def keys(self, token_ids: list[int], start: int, end: int) -> tuple[int, ...]:
        """The block-hash keys of tokens start .. end - 1: their ids, with each image token replaced by a
        negative value drawn from its image's digest and its offset in the image."""
        keys = list(token_ids[start:end])
        for span, first, last in self.overlapping(start, end):
            base = span.image.digest & ((1 << 62) - 1)
            for offset in range(first, last):
                keys[span.start + offset - start] = -2 - ((base + offset) & ((1 << 62) - 1))
        return tuple(keys)
