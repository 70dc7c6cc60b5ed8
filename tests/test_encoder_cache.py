"""The encoder cache: the tower runs once per image, least recently used images go first past the budget,
and never one the step reads."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from tinymlx.core.images import ProcessedImage
from tinymlx.vision.encoder_cache import EncoderCache


def _image(seed: int, tokens: int = 4) -> ProcessedImage:
    return ProcessedImage(np.random.default_rng(seed).normal(size=(tokens, 3)).astype(np.float32), None, tokens)


def _cache(budget_images: int):
    encoded = []

    def encode(images: list[ProcessedImage]) -> list[mx.array]:
        encoded.append([image.digest for image in images])
        return [mx.array(image.pixel_values) * 2 for image in images]

    return EncoderCache(encode, budget_images * 4 * 3 * 4), encoded


def test_rows_are_the_features_of_each_piece_and_the_tower_runs_once_per_image():
    cache, encoded = _cache(budget_images=4)
    a, b = _image(0), _image(1)
    rows = cache.rows([(a, 1, 3), (b, 0, 4), (a, 3, 4)])
    expected = np.concatenate([a.pixel_values[1:3], b.pixel_values, a.pixel_values[3:4]]) * 2
    assert np.allclose(np.array(rows), expected)
    assert encoded == [[a.digest, b.digest]]  # both new images in one run of the tower
    cache.rows([(b, 0, 2)])
    assert cache.num_encoded_images == 2 and cache.num_hits == 1


def test_the_least_recently_used_image_goes_first_past_the_budget():
    cache, encoded = _cache(budget_images=2)
    a, b, c = _image(0), _image(1), _image(2)
    cache.rows([(a, 0, 4)])
    cache.rows([(b, 0, 4)])
    cache.rows([(a, 0, 4)])  # a is now the most recent
    cache.rows([(c, 0, 4)])  # b goes
    assert cache.num_images == 2 and cache.num_bytes <= cache.budget_bytes
    cache.rows([(a, 0, 4)])
    cache.rows([(b, 0, 4)])
    assert [digest for run in encoded for digest in run] == [a.digest, b.digest, c.digest, b.digest]


def test_a_step_over_the_budget_keeps_what_it_reads():
    cache, _ = _cache(budget_images=1)
    a, b = _image(0), _image(1)
    rows = cache.rows([(a, 0, 4), (b, 0, 4)])
    assert rows.shape == (8, 3) and cache.num_images == 2  # both read now; the next step may drop them
    cache.rows([(b, 0, 4)])
    assert cache.num_images == 1
