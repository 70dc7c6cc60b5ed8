"""Gemma 3 with its vision tower against transformers: a tiny random checkpoint, images drawn with Pillow, the
same logits at prefill (each image's tokens attending to each other both ways) and at every teacher-forced
decode step through the paged cache; the scheduler never splits an image across chunks."""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import max_diff, paged_logits
from vision_checkpoints import (
    BOI,
    EOI,
    IMAGE_SOFT,
    drawn_image,
    gemma3_vl_checkpoint,
    image_messages,
    load_engine,
    png_bytes,
    run_requests,
)

from tinymlx import SamplingParams
from tinymlx.models import load_model
from tinymlx.vision.gemma_processor import Gemma3ImageProcessor

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _engine(path, **config):
    return load_engine(path, **{"block_size": 4, **config})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3_vl")
    return path, gemma3_vl_checkpoint(path)


def _hf_logits(hf_model, tokens: list[int], images) -> np.ndarray:
    ids = torch.tensor([tokens])
    with torch.no_grad():
        return hf_model(input_ids=ids, pixel_values=torch.tensor(np.stack([i.pixel_values for i in images])),
                        token_type_ids=(ids == IMAGE_SOFT).long()).logits[0].float().numpy()


@pytest.mark.parametrize("block_size", [4, 16])
def test_logits_equal_transformers_at_prefill_and_every_decode_step(checkpoint, kernel_path, block_size):
    """Two images, the second past the sliding window of the first; every layer sees each image whole."""
    path, hf_model = checkpoint
    model = load_model(path, dtype="float32")
    processor = Gemma3ImageProcessor.from_dir(path)
    images = [processor(drawn_image(90, 60)), processor(drawn_image(40, 130, seed=1))]
    prompt = list(b"<user>look ") + [BOI] + list(b" and then ") + [BOI] + list(b" now\n<assistant>")
    token_ids, placed = model.place_images(prompt, images)
    assert [token_ids[span.start:span.end] for span in placed.spans] == [[IMAGE_SOFT] * 4] * 2
    tokens = token_ids + np.random.default_rng(2).integers(0, 256, 12).tolist()
    reference = _hf_logits(hf_model, tokens, images)
    paged = paged_logits(model, tokens, prompt_len=len(token_ids), block_size=block_size, query_tile=4,
                         images=placed)
    for step, logits in enumerate(paged):
        assert max_diff(logits, reference[len(token_ids) - 1 + step]) < ATOL, step


def test_an_image_attends_both_ways(checkpoint, monkeypatch):
    """Causal attention over the image's tokens gives other logits: the parity above checks the mask."""
    path, hf_model = checkpoint
    image = Gemma3ImageProcessor.from_dir(path)(drawn_image(60, 60))
    model = load_model(path, dtype="float32")
    tokens, placed = model.place_images(list(b"<user>") + [BOI] + list(b"?\n<assistant>"), [image])
    reference = _hf_logits(hf_model, tokens, [image])[len(tokens) - 1]
    both_ways = paged_logits(model, tokens, prompt_len=len(tokens), block_size=4, images=placed)
    assert max_diff(both_ways[0], reference) < ATOL
    monkeypatch.setattr(type(model), "attends_whole_images", lambda self, spec: False)
    causal = paged_logits(model, tokens, prompt_len=len(tokens), block_size=4, images=placed)
    assert max_diff(causal[0], reference) > 1e-3


def test_small_chunks_never_split_an_image_and_equal_one_chunk(checkpoint):
    """A budget of 6 tokens would cut each 4-token image; the scheduler moves the cut to the image's start."""
    path, _ = checkpoint
    images = [png_bytes(drawn_image(80, 50, seed=s)) for s in range(3)]
    requests = {"a": image_messages(images[0], images[1]), "b": image_messages(images[2], text="one"),
                "text": [{"role": "user", "content": "no image here"}]}
    whole = run_requests(_engine(path, enable_prefix_caching=False), requests, GREEDY)
    engine = _engine(path, max_num_batched_tokens=6)
    chunks = []
    schedule = engine.scheduler.schedule

    def spy():
        batch = schedule()
        chunks.extend(batch.chunks)
        return batch

    engine.scheduler.schedule = spy
    assert run_requests(engine, requests, GREEDY) == whole
    assert any(c.images is not None and len(c.token_ids) > 1 for c in chunks)
    for chunk in chunks:
        if chunk.images is None:
            continue
        end = chunk.start_position + len(chunk.token_ids)
        assert not any(span.start < end < span.end for span in chunk.images.spans), "an image split across chunks"


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


def test_tensor_parallel_with_images_equals_one_rank(checkpoint):
    """Each image's both-ways mask reaches the other rank with the step's inputs."""
    path, _ = checkpoint
    requests = {"a": image_messages(png_bytes(drawn_image(80, 50))), "text": [{"role": "user", "content": "hi"}]}
    reference = run_requests(_engine(path), requests, GREEDY)
    engine = _engine(path, tensor_parallel_size=2)
    try:
        assert run_requests(engine, requests, GREEDY) == reference
    finally:
        engine.close()


def test_an_image_larger_than_a_step_is_refused(checkpoint):
    """Its tokens attend both ways, so it is computed in one step: one that can never fit is a clear error."""
    path, _ = checkpoint
    with pytest.raises(ValueError, match="an image of 4 tokens must be computed in one step"):
        _engine(path, max_num_batched_tokens=3).prepare(image_messages(png_bytes(drawn_image(40, 40))), GREEDY)


def test_the_engine_writes_a_blank_line_around_each_image_as_transformers_does(checkpoint):
    path, _ = checkpoint
    engine = _engine(path)
    request = engine.prepare(image_messages(png_bytes(drawn_image(40, 40))), GREEDY)
    span = request.images.spans[0]
    newlines = list(b"\n\n")
    assert request.token_ids[span.start - 3:span.start] == newlines + [BOI]
    assert request.token_ids[span.end:span.end + 3] == [EOI] + newlines
