"""Qwen2.5-VL against transformers, and images through the engine: a tiny random checkpoint written by
save_pretrained, real images drawn with Pillow, the same logits at prefill and at every teacher-forced decode
step through the paged cache; then batching, chunking, prefix hits, preemption and bad input."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tiny_models import max_diff, paged_logits, save_byte_tokenizer, tiny_model
from vision_checkpoints import (
    IMAGE_PAD,
    drawn_image,
    image_messages,
    load_engine,
    png_bytes,
    qwen2_5_vl_checkpoint,
    qwen_prompt,
    run_requests,
)

from tinymlx import LLM, SamplingParams
from tinymlx.core.config import EngineConfig
from tinymlx.engine.engine import Engine
from tinymlx.models import load_model
from tinymlx.text.tokenizer import Tokenizer
from tinymlx.vision.qwen_processor import QwenImageProcessor

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _engine(path, **config):
    return load_engine(path, **{"max_num_batched_tokens": 64, **config})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    return path, qwen2_5_vl_checkpoint(path)


def test_rope_positions_equal_transformers(checkpoint):
    path, hf_model = checkpoint
    model = load_model(path, dtype="float32")
    processor = QwenImageProcessor.from_dir(path)
    images = [processor(drawn_image(90, 60)), processor(drawn_image(40, 130, seed=1))]
    token_ids, placed = model.place_images(qwen_prompt(2), images)
    ids = torch.tensor([token_ids])
    reference, delta = hf_model.model.get_rope_index(
        ids, mm_token_type_ids=(ids == IMAGE_PAD).int(),
        image_grid_thw=torch.tensor([image.grid_thw for image in images]))
    assert np.array_equal(placed.rope_positions, reference[:, 0].numpy())
    assert placed.rope_delta == int(delta[0, 0])
    assert [span.length for span in placed.spans] == [image.num_tokens for image in images]


@pytest.mark.parametrize("block_size, chunk_size", [(4, 7), (16, None)])
def test_logits_equal_transformers_at_prefill_and_every_decode_step(checkpoint, kernel_path, block_size, chunk_size):
    """Two images of different shapes; chunks of 7 tokens cut through both images' spans."""
    path, hf_model = checkpoint
    model = load_model(path, dtype="float32")
    processor = QwenImageProcessor.from_dir(path)
    images = [processor(drawn_image(90, 60)), processor(drawn_image(40, 130, seed=1))]
    token_ids, placed = model.place_images(qwen_prompt(2), images)
    continuation = np.random.default_rng(2).integers(0, 256, 10).tolist()
    tokens = token_ids + continuation
    ids = torch.tensor([tokens])
    with torch.no_grad():
        reference = hf_model(
            input_ids=ids, pixel_values=torch.tensor(np.concatenate([i.pixel_values for i in images])),
            image_grid_thw=torch.tensor([i.grid_thw for i in images]),
            mm_token_type_ids=(ids == IMAGE_PAD).int()).logits[0].float().numpy()
    paged = paged_logits(model, tokens, prompt_len=len(token_ids), block_size=block_size, chunk_size=chunk_size,
                         query_tile=8, images=placed)
    assert len(paged) == len(continuation) + 1
    for step, logits in enumerate(paged):
        assert max_diff(logits, reference[len(token_ids) - 1 + step]) < ATOL, step


def test_a_batch_of_image_and_text_requests_equals_each_alone(checkpoint):
    path, _ = checkpoint
    cat, dog = png_bytes(drawn_image(120, 90)), png_bytes(drawn_image(70, 70, seed=3))
    requests = {"cat": image_messages(cat), "text": [{"role": "user", "content": "hello there"}],
                "both": image_messages(dog, cat, text="compare")}
    alone = {}
    for request_id, messages in requests.items():
        alone.update(run_requests(_engine(path, enable_prefix_caching=False), {request_id: messages}, GREEDY))
    engine = _engine(path)
    assert run_requests(engine, requests, GREEDY) == alone
    assert engine.runner.encoder_cache.num_encoded_images == 2  # cat once, though two requests show it


def test_the_same_image_is_a_prefix_hit_and_a_different_one_never(checkpoint):
    path, _ = checkpoint
    engine = _engine(path)
    first = run_requests(engine, {"a": image_messages(png_bytes(drawn_image(100, 80)))}, GREEDY)
    encoded = engine.runner.encoder_cache.num_encoded_images
    again = engine.add_request(image_messages(png_bytes(drawn_image(100, 80))), GREEDY, request_id="a")
    engine.step()
    seq = engine.requests.get(again).seq
    assert seq.num_cached_tokens >= seq.num_prompt_tokens - engine.config.block_size
    assert run_requests(engine, {}, GREEDY) == first
    assert engine.runner.encoder_cache.num_encoded_images == encoded  # not encoded again
    other = engine.add_request(image_messages(png_bytes(drawn_image(100, 80, seed=9))), GREEDY)
    engine.step()
    seq = engine.requests.get(other).seq
    assert seq.num_cached_tokens <= seq.images.spans[0].start  # the text before the image, no further
    run_requests(engine, {}, GREEDY)


def test_cached_preempted_and_uncached_runs_agree(checkpoint):
    path, _ = checkpoint
    requests = {f"r{i}": image_messages(png_bytes(drawn_image(60 + 20 * i, 90, seed=i))) for i in range(4)}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    uncached = run_requests(_engine(path, enable_prefix_caching=False), requests, params)
    assert run_requests(_engine(path), requests, params) == uncached
    tight = _engine(path, num_pages=16, max_num_batched_tokens=32)
    assert run_requests(tight, requests, params) == uncached
    assert tight.scheduler.num_preemptions > 0


def test_a_text_model_gets_a_note_or_refuses(tmp_path):
    model = tiny_model()
    engine = Engine(model, Tokenizer.from_dir(save_byte_tokenizer(tmp_path)), EngineConfig())
    image = png_bytes(drawn_image(30, 30))
    request = engine.prepare(image_messages(image), GREEDY)
    assert b"an image was omitted" in bytes(t for t in request.token_ids if t < 256)
    assert engine.images.num_omitted_images == 1
    refusing = Engine(model, engine.tokenizer, EngineConfig(images="refuse"))
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\].*reads text only"):
        refusing.prepare(image_messages(image), GREEDY)


@pytest.mark.parametrize("image, message", [
    (b"\x89PNG\r\n\x1a\nbroken", "messages\\[0\\]\\.content\\[0\\]"),
    (b"not an image at all", "messages\\[0\\]\\.content\\[0\\]"),
    ("data:image/png;base64,@@@", "messages\\[0\\]\\.content\\[0\\]"),
])
def test_bad_images_are_refused_by_part_and_the_engine_serves_on(checkpoint, image, message):
    path, _ = checkpoint
    engine = _engine(path)
    engine.add_request(image_messages(png_bytes(drawn_image(50, 50))), GREEDY, request_id="good")
    with pytest.raises(ValueError, match=message):
        engine.add_request(image_messages(image), GREEDY)
    assert list(run_requests(engine, {}, GREEDY)) == ["good"]  # the good one finishes, nothing leaks (_run checks)


def test_too_many_images_or_bytes_are_refused(checkpoint):
    path, _ = checkpoint
    image = png_bytes(drawn_image(40, 40))
    with pytest.raises(ValueError, match="at most 2"):
        _engine(path, max_images_per_request=2).prepare(image_messages(image, image, image), GREEDY)
    with pytest.raises(ValueError, match="max-image-bytes"):
        _engine(path, max_image_bytes=len(image) + 10).prepare(image_messages(image, image), GREEDY)


def test_a_new_process_serves_the_same_image_from_the_disk_tier(checkpoint, tmp_path):
    """The block hashes of image tokens are the image's content digest: the same in every process."""
    path, _ = checkpoint
    worker = Path(__file__).with_name("disk_cache_worker.py")

    def data_url(image) -> str:
        return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()

    def run(image) -> dict:
        spec = {"model": str(path), "disk_cache_dir": str(tmp_path / "disk"), "max_tokens": 6,
                "prompts": [image_messages(data_url(image))]}
        done = subprocess.run([sys.executable, str(worker), json.dumps(spec)], capture_output=True, text=True,
                              timeout=300, cwd=worker.parent)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold, warm, other = run(drawn_image(100, 80)), run(drawn_image(100, 80)), run(drawn_image(100, 80, seed=5))
    assert cold["tokens"] == warm["tokens"]
    assert cold["disk"]["num_hits"] == 0 and warm["disk"]["num_hits"] > 0
    prompt_len = cold["num_computed_prompt_tokens"]
    assert warm["num_cached_tokens"][0] >= prompt_len - 4  # all but the last block (block size 4)
    assert other["num_cached_tokens"][0] < 8  # "<user>" and the vision start, before the image: no further


def test_tensor_parallel_with_images_equals_one_rank(checkpoint):
    """The tower runs on rank 0; the other rank gets the image rows' features with the step's inputs."""
    path, _ = checkpoint
    requests = {"a": image_messages(png_bytes(drawn_image(90, 60))), "text": [{"role": "user", "content": "hi"}],
                "b": image_messages(png_bytes(drawn_image(50, 120, seed=4)), png_bytes(drawn_image(90, 60)))}
    reference = run_requests(_engine(path), requests, GREEDY)
    engine = _engine(path, tensor_parallel_size=2)
    try:
        assert run_requests(engine, requests, GREEDY) == reference
        assert engine.stats().comm_total.num_all_reduces > 0
    finally:
        engine.close()


def test_two_images_of_one_size_give_different_logits(checkpoint):
    path, _ = checkpoint
    model = load_model(path, dtype="float32")
    processor = QwenImageProcessor.from_dir(path)
    logits = []
    for seed in (0, 1):
        token_ids, placed = model.place_images(qwen_prompt(1), [processor(drawn_image(90, 60, seed=seed))])
        logits.append(paged_logits(model, token_ids, prompt_len=len(token_ids), block_size=4, images=placed)[0])
    assert max_diff(logits[0], np.array(logits[1])) > 1e-3


def test_speculation_keeps_the_positions_of_an_imageqwen_prompt(checkpoint):
    """n-gram drafts verify past the prompt at position + rope_delta: the same tokens as plain decoding."""
    path, _ = checkpoint
    messages = {"r": image_messages(png_bytes(drawn_image(90, 60)), text="abcabcabcabcabc")}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = run_requests(_engine(path), messages, params)
    engine = _engine(path, speculative="ngram")
    assert run_requests(engine, messages, params) == plain
    assert engine.stats().num_draft_tokens > 0


def test_llm_chat_takes_paths_bytes_pil_images_and_data_urls(checkpoint, tmp_path):
    path, _ = checkpoint
    image = drawn_image(70, 50)
    image.save(tmp_path / "shot.png")
    url = "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
    with LLM(str(path), block_size=8, progress=False) as llm:
        outs = llm.chat([image_messages(source) for source in (tmp_path / "shot.png", str(tmp_path / "shot.png"),
                                                             png_bytes(image), image, url)], GREEDY)
        assert len({tuple(out.token_ids) for out in outs}) == 1  # one image, five ways
        assert llm.stats().images.num_encoded_images == 1
        assert llm.stats().images.cache_bytes <= llm.stats().images.cache_bytes_budget
