"""Qwen3-VL (DeepStack) and Qwen3.5 (Gated DeltaNet + gated attention) with images, and their MoE variants,
against transformers: tiny random checkpoints written by save_pretrained, real images drawn with Pillow, the
rope index, and the same logits at prefill and at every teacher-forced decode step through the paged cache
with chunks cutting through the images' spans; then images through the engine: batching, and the same image
again as a prefix hit (for the hybrid, resumed from a state checkpoint) that never runs the tower again."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny_models import max_diff, paged_logits
from vision_checkpoints import (
    IMAGE_PAD,
    QWEN3_VL_VARIANTS,
    drawn_image,
    image_messages,
    load_engine,
    png_bytes,
    qwen3_vl_checkpoint,
    qwen_prompt,
    run_requests,
)

from tinymlx import SamplingParams
from tinymlx.core.layer_specs import FullAttention, Recurrent
from tinymlx.models import args_from_config, load_model
from tinymlx.vision.qwen_processor import QwenImageProcessor

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ATOL = 1e-4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _engine(path, **config):
    return load_engine(path, **{"max_num_batched_tokens": 64, **config})


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """variant -> (path, transformers model), each written once for the module."""
    written = {}

    def checkpoint_of(variant: str):
        if variant not in written:
            path = tmp_path_factory.mktemp(variant)
            written[variant] = path, qwen3_vl_checkpoint(path, variant)
        return written[variant]

    return checkpoint_of


@pytest.fixture(scope="module", params=list(QWEN3_VL_VARIANTS))
def checkpoint(request, checkpoints):
    return checkpoints(request.param)


def _images(path) -> list:
    """Two images of different shapes: 6 x 8 patches (12 tokens) and 10 x 4 (10 tokens)."""
    processor = QwenImageProcessor.from_dir(path)
    return [processor(drawn_image(130, 100)), processor(drawn_image(60, 150, seed=1))]


def test_the_layers_and_the_tower_load_as_configured(checkpoint):
    path, hf_model = checkpoint
    model = load_model(path, dtype="float32")
    assert model.visual.num_deepstack_levels == len(getattr(hf_model.model.visual, "deepstack_merger_list", []))
    if model.args.model_type.startswith("qwen3_5"):
        assert [type(spec) for spec in model.layer_specs()] == [Recurrent, FullAttention, Recurrent, FullAttention]


def test_a_transformers_4_config_reads_as_the_5_one(checkpoint):
    """4.x (the Hub's Qwen3-VL) keeps the M-RoPE layout in text_config.rope_scaling, rope_theta beside it."""
    path, _ = checkpoint
    config = json.loads((path / "config.json").read_text())
    text = dict(config["text_config"])
    rope = dict(text.pop("rope_parameters"))
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = rope
    if "partial_rotary_factor" in rope:
        text["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    assert args_from_config({**config, "text_config": text}) == args_from_config(config)


def test_the_hubs_input_major_experts_load_as_transformers_saves_them(checkpoints, tmp_path_factory):
    """The Hub's Qwen3-VL-MoE stores gate_up_proj [E, D, 2I] and down_proj [E, I, D]; transformers 5 saves
    [E, 2I, D] and [E, D, I]: the same model either way."""
    path, _ = checkpoints("qwen3_vl_moe")
    hub = tmp_path_factory.mktemp("hub_layout")
    shutil.copytree(path, hub, dirs_exist_ok=True)
    weights = mx.load(str(path / "model.safetensors"))
    mx.save_safetensors(str(hub / "model.safetensors"), {
        name: value.swapaxes(1, 2) if ".mlp.experts." in name else value for name, value in weights.items()})
    assert any(".mlp.experts." in name for name in weights)
    ours, theirs = (dict(tree_flatten(load_model(p, dtype="float32").parameters())) for p in (path, hub))
    assert all(mx.array_equal(ours[name], theirs[name]) for name in ours)


def test_rope_positions_equal_transformers(checkpoint):
    path, hf_model = checkpoint
    model = load_model(path, dtype="float32")
    images = _images(path)
    token_ids, placed = model.place_images(qwen_prompt(2), images)
    ids = torch.tensor([token_ids])
    reference, delta = hf_model.model.get_rope_index(
        ids, mm_token_type_ids=(ids == IMAGE_PAD).int(),
        image_grid_thw=torch.tensor([image.grid_thw for image in images]))
    assert np.array_equal(placed.rope_positions, reference[:, 0].numpy())
    assert placed.rope_delta == int(delta[0, 0])
    assert [span.length for span in placed.spans] == [image.num_tokens for image in images]


def test_logits_equal_transformers_at_prefill_and_every_decode_step(checkpoint, kernel_path):
    """Blocks of 4, chunks of 7 tokens: they cut through both images' spans (12 and 10 tokens), so a chunk
    takes part of an image's rows, of every DeepStack level."""
    path, hf_model = checkpoint
    model = load_model(path, dtype="float32")
    images = _images(path)
    token_ids, placed = model.place_images(qwen_prompt(2), images)
    continuation = np.random.default_rng(2).integers(0, 256, 10).tolist()
    tokens = token_ids + continuation
    ids = torch.tensor([tokens])
    with torch.no_grad():
        reference = hf_model(
            input_ids=ids, pixel_values=torch.tensor(np.concatenate([i.pixel_values for i in images])),
            image_grid_thw=torch.tensor([i.grid_thw for i in images]),
            mm_token_type_ids=(ids == IMAGE_PAD).int()).logits[0].float().numpy()
    paged = paged_logits(model, tokens, prompt_len=len(token_ids), block_size=4, chunk_size=7, query_tile=8,
                         images=placed)
    assert len(paged) == len(continuation) + 1
    for step, logits in enumerate(paged):
        assert max_diff(logits, reference[len(token_ids) - 1 + step]) < ATOL, step


ENGINE_VARIANTS = list(QWEN3_VL_VARIANTS)  # DeepStack; the hybrid resumes from state checkpoints


@pytest.mark.parametrize("variant", ENGINE_VARIANTS)
def test_a_batch_of_image_and_text_requests_equals_each_alone(variant, checkpoints):
    path, _ = checkpoints(variant)
    cat, dog = png_bytes(drawn_image(120, 90)), png_bytes(drawn_image(70, 70, seed=3))
    requests = {"cat": image_messages(cat), "text": [{"role": "user", "content": "hello there"}],
                "both": image_messages(dog, cat, text="compare")}
    alone = {}
    for request_id, messages in requests.items():
        alone.update(run_requests(_engine(path, enable_prefix_caching=False), {request_id: messages}, GREEDY))
    engine = _engine(path)
    assert run_requests(engine, requests, GREEDY) == alone
    assert engine.runner.encoder_cache.num_encoded_images == 2  # cat once, though two requests show it


@pytest.mark.parametrize("variant", ENGINE_VARIANTS)
def test_the_same_image_is_a_prefix_hit_without_encoding_and_a_different_one_never(variant, checkpoints):
    path, _ = checkpoints(variant)
    engine = _engine(path)
    before = "Here is a picture for you: "  # the image starts at token 34, in the fifth block of 8
    first = run_requests(engine, {"a": image_messages(png_bytes(drawn_image(100, 80)), before=before)}, GREEDY)["a"]
    encoded = engine.runner.encoder_cache.num_encoded_images
    engine.runner.encoder_cache.clear()  # a hit must not need the tower, nor its cached output
    engine.add_request(image_messages(png_bytes(drawn_image(100, 80)), before=before), GREEDY, request_id="again")
    engine.step()
    seq = engine.requests.get("again").seq
    assert seq.num_cached_tokens >= seq.images.spans[0].end  # past the image: for the hybrid, a state checkpoint
    assert seq.num_cached_tokens >= seq.num_prompt_tokens - engine.config.block_size
    assert run_requests(engine, {}, GREEDY)["again"] == first
    assert engine.runner.encoder_cache.num_encoded_images == encoded
    engine.add_request(image_messages(png_bytes(drawn_image(100, 80, seed=9)), before=before), GREEDY,
                       request_id="other")
    engine.step()
    seq = engine.requests.get("other").seq
    assert seq.num_cached_tokens <= seq.images.spans[0].start  # at most the text before the image
    run_requests(engine, {}, GREEDY)
    assert engine.runner.encoder_cache.num_encoded_images == encoded + 1


@pytest.mark.parametrize("variant", ENGINE_VARIANTS)
def test_cached_preempted_and_uncached_runs_agree(variant, checkpoints):
    path, _ = checkpoints(variant)
    requests = {f"r{i}": image_messages(png_bytes(drawn_image(60 + 20 * i, 90, seed=i))) for i in range(4)}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    uncached = run_requests(_engine(path, enable_prefix_caching=False), requests, params)
    assert run_requests(_engine(path), requests, params) == uncached
    tight = _engine(path, num_pages=16, max_num_batched_tokens=32)
    assert run_requests(tight, requests, params) == uncached
    assert tight.scheduler.num_preemptions > 0
