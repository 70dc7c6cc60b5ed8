"""Gemma 4 with its vision encoder against transformers, on tiny random checkpoints (vision_checkpoints.py): a plain
one (causal over images) and a rich one (per-layer inputs, KV-shared layers, images attending both ways in the
sliding layers). The same logits at prefill and at every teacher-forced decode step through the paged cache;
each part of the image handling matters (the mask, only in sliding layers; the pad id in the per-layer inputs);
small chunks never split an image that attends both ways and give one chunk's tokens; the same image again is a
prefix hit, encoded once."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from tiny_models import max_diff, paged_logits
from vision_checkpoints import (
    GEMMA4_BOI,
    GEMMA4_EOI,
    GEMMA4_IMAGE,
    drawn_image,
    gemma4_vl_checkpoint,
    image_messages,
    load_engine,
    png_bytes,
    run_requests,
)

from tinymlx import SamplingParams
from tinymlx.models import load_model
from tinymlx.vision.gemma_processor import Gemma4ImageProcessor, gemma4_position_ids

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _engine(path, **config):
    return load_engine(path, **{"block_size": 4, **config})


@pytest.fixture(scope="module", params=["plain", "rich"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"gemma4_vl_{request.param}")
    return path, gemma4_vl_checkpoint(path, request.param)


@pytest.fixture(scope="module")
def rich(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma4_vl_rich_alone")
    return path, gemma4_vl_checkpoint(path, "rich")


def _hf_logits(hf_model, tokens: list[int], images) -> np.ndarray:
    """transformers' forward with the images padded to one patch count, as its processor pads them."""
    longest = max(image.pixel_values.shape[0] for image in images)
    pixels = np.zeros((len(images), longest, images[0].pixel_values.shape[1]), np.float32)
    positions = np.full((len(images), longest, 2), -1, np.int64)
    for i, image in enumerate(images):
        pixels[i, :len(image.pixel_values)] = image.pixel_values
        positions[i, :len(image.pixel_values)] = gemma4_position_ids(image.grid_thw)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        return hf_model(input_ids=ids, pixel_values=torch.from_numpy(pixels),
                        image_position_ids=torch.from_numpy(positions),
                        mm_token_type_ids=(ids == GEMMA4_IMAGE).long()).logits[0].float().numpy()


def _placed(model, path, sizes: list[tuple[int, int]], end: bytes = b" now\n<assistant>"):
    """A prompt with an image of each (width, height), then `end`, placed; its images."""
    processor = Gemma4ImageProcessor.from_dir(path)
    images = [processor(drawn_image(w, h, seed=i)) for i, (w, h) in enumerate(sizes)]
    prompt = list(b"<user>look:")
    for i, _ in enumerate(images):
        prompt += list(b" and " if i else b"") + [GEMMA4_IMAGE]
    token_ids, placed = model.place_images(prompt + list(end), images)
    return token_ids, placed, images


@pytest.mark.parametrize("block_size", [4, 16])
def test_logits_equal_transformers_at_prefill_and_every_decode_step(checkpoint, kernel_path, block_size):
    """Two images of different grids (two runs of the tower), each far longer than the window. The causal
    model's prompt also runs in chunks of 16 that cut through both images."""
    path, hf_model = checkpoint
    model = load_model(path, dtype="float32")
    token_ids, placed, images = _placed(model, path, [(90, 60), (40, 130)])
    assert images[0].grid_thw != images[1].grid_thw
    for span in placed.spans:
        assert token_ids[span.start - 1] == GEMMA4_BOI and token_ids[span.end] == GEMMA4_EOI
        assert token_ids[span.start:span.end] == [GEMMA4_IMAGE] * span.length and span.length > 40
    tokens = token_ids + np.random.default_rng(2).integers(0, 256, 12).tolist()
    reference = _hf_logits(hf_model, tokens, images)
    chunk_size = None if placed.whole_spans else 16
    paged = paged_logits(model, tokens, prompt_len=len(token_ids), block_size=block_size, chunk_size=chunk_size,
                         query_tile=16, images=placed)
    assert len(paged) == len(tokens) - len(token_ids) + 1
    for step, logits in enumerate(paged):
        assert max_diff(logits, reference[len(token_ids) - 1 + step]) < ATOL, step


def test_the_mask_and_the_per_layer_pad_id_each_matter(rich, monkeypatch):
    """Against transformers' logits: images seen causally everywhere, or both ways in the global layers too, or
    the per-layer embedding reading the image token's id, each gives other logits. (The prompt ends right after
    the image, within a window of it: a global layer's image rows reach the last token only through a later
    sliding layer's K/V.)"""
    path, hf_model = rich
    model = load_model(path, dtype="float32")
    tokens, placed, images = _placed(model, path, [(60, 60)], end=b"?")
    assert placed.whole_spans
    reference = _hf_logits(hf_model, tokens, images)[len(tokens) - 1]

    def last_logits() -> np.ndarray:
        return paged_logits(model, tokens, prompt_len=len(tokens), block_size=4, images=placed)[0]

    assert max_diff(last_logits(), reference) < ATOL
    with monkeypatch.context() as patch:
        patch.setattr(type(model), "attends_whole_images", lambda self, spec: False)
        assert max_diff(last_logits(), reference) > 1e-3
    with monkeypatch.context() as patch:
        patch.setattr(type(model), "attends_whole_images", lambda self, spec: True)
        assert max_diff(last_logits(), reference) > 1e-3
    with monkeypatch.context() as patch:
        patch.setattr(model, "args", dataclasses.replace(model.args, pad_token_id=GEMMA4_IMAGE))
        assert max_diff(last_logits(), reference) > 1e-3


def test_small_chunks_never_split_an_image_that_attends_both_ways_and_equal_one_chunk(checkpoint):
    """A budget of 80 tokens cuts the first request's second image; with images attending both ways the
    scheduler moves the cut to the image's start, and a causal model's image is split as any text."""
    path, _ = checkpoint
    images = [png_bytes(drawn_image(80, 50, seed=s)) for s in range(3)]
    requests = {"a": image_messages(images[0], images[1]), "b": image_messages(images[2], text="one"),
                "text": [{"role": "user", "content": "no image here"}]}
    whole = run_requests(_engine(path, enable_prefix_caching=False), requests, GREEDY)
    engine = _engine(path, max_num_batched_tokens=80)
    chunks = []
    schedule = engine.scheduler.schedule

    def spy():
        batch = schedule()
        chunks.extend(batch.chunks)
        return batch

    engine.scheduler.schedule = spy  # (the runner's run and start both take what it schedules)
    assert run_requests(engine, requests, GREEDY) == whole
    assert any(chunk.images is not None for chunk in chunks)
    split = [chunk for chunk in chunks if chunk.images is not None and any(
        span.start < chunk.start_position + len(chunk.token_ids) < span.end for span in chunk.images.spans)]
    assert not split if engine.runner.model.args.sees_images_both_ways else split


def test_the_same_image_is_a_prefix_hit(checkpoint):
    path, _ = checkpoint
    engine = _engine(path)
    image = png_bytes(drawn_image(70, 70))
    first = run_requests(engine, {"a": image_messages(image)}, GREEDY)
    encoded = engine.runner.encoder_cache.num_encoded_images
    again = engine.add_request(image_messages(image), GREEDY, request_id="b")
    engine.step()
    seq = engine.requests.get(again).seq
    assert seq.num_cached_tokens > seq.images.spans[0].end - engine.config.block_size
    assert run_requests(engine, {}, GREEDY) == {"b": first["a"]}
    assert engine.runner.encoder_cache.num_encoded_images == encoded
