"""The encoder cache: each image's vision-tower output, kept by its content digest, so the tower runs once
per image however many chunks, requests and turns consume it. Bounded in bytes, least recently used first.

It has one writer, the runner's step (runner/model_runner.py), which asks it for the rows a step's chunks
cover; the images it lacks are encoded together, in one run of the tower.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import mlx.core as mx

from tinymlx.core.images import ProcessedImage

ImagePiece = tuple[ProcessedImage, int, int]  # an image, and the first and last + 1 of its tokens a chunk takes


class EncoderCache:
    def __init__(self, encode: Callable[[list[ProcessedImage]], list[mx.array]], budget_bytes: int):
        """`encode`: the model's vision tower, images -> each one's [num_tokens, hidden] rows."""
        self._encode, self.budget_bytes = encode, budget_bytes
        self._features: OrderedDict[int, mx.array] = OrderedDict()
        self.num_encoded_images = 0  # runs of the tower, image by image
        self.num_hits = 0  # images a step found here

    @property
    def num_bytes(self) -> int:
        return sum(features.nbytes for features in self._features.values())

    @property
    def num_images(self) -> int:
        return len(self._features)

    def rows(self, pieces: list[ImagePiece]) -> mx.array:
        """The tower's rows for each piece, concatenated in order: [sum of last - first, hidden]."""
        wanted = {image.digest: image for image, _, _ in pieces}
        missing = [image for digest, image in wanted.items() if digest not in self._features]
        self.num_hits += len(wanted) - len(missing)
        if missing:
            encoded = self._encode(missing)
            mx.eval(encoded)  # kept as data: the cache must not hold the tower's graph (and the pixels) instead
            for image, features in zip(missing, encoded):
                self._features[image.digest] = features
            self.num_encoded_images += len(missing)
        for digest in wanted:
            self._features.move_to_end(digest)
        rows = mx.concatenate([self._features[image.digest][first:last] for image, first, last in pieces])
        self._evict(keep=set(wanted))
        return rows

    def _evict(self, keep: set[int]) -> None:
        """Drop the least recently used images past the budget; never this step's (they are read now)."""
        used = self.num_bytes
        for digest in list(self._features):
            if used <= self.budget_bytes:
                break
            if digest not in keep:
                used -= self._features.pop(digest).nbytes

    def clear(self) -> None:
        self._features.clear()
