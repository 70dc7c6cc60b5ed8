"""Gemma 3's vision tower (SigLIP + projector) and Gemma 4's vision encoder (+ embed_vision) against
transformers' get_image_features, in float32, on tiny random checkpoints: one image, two in one call (each
equal to itself alone), the checkpoint names of every layout sanitize accepts; for Gemma 4, images of two
aspect ratios from its own image processor (padded to one length), clipped linears and standardization on."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tinymlx.models import gemma3_vision, gemma4_vision

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

ATOL = 1e-4
TEXT = dict(vocab_size=300, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16)


def redraw(model, std: float = 0.2) -> None:
    """Every weight normal(0, std), so every term matters; norms scaling by w drawn about 1 (Gemma 3's
    RMSNorm scales by 1 + w: drawn about 0)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, std)
            if ("norm" in name and "mm_soft_emb_norm" not in name) or name.endswith("std_scale"):
                param.add_(1.0)
    model.eval()


def load_tower(module, path: Path) -> mx.Module:
    tower = module.VisionTower.from_config(json.loads((path / "config.json").read_text()))
    tower.load_weights(list(tower.sanitize(mx.load(str(path / "model.safetensors"))).items()), strict=True)
    return tower


def max_diff(ours: mx.array, theirs) -> float:
    return float(np.abs(np.array(ours) - theirs.detach().numpy()).max())


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=56, patch_size=14, vision_use_head=False)
    config = transformers.Gemma3Config(text_config=TEXT, vision_config=vision, mm_tokens_per_image=4)
    config._attn_implementation = "eager"
    model = transformers.Gemma3ForConditionalGeneration(config)
    redraw(model)
    path = tmp_path_factory.mktemp("gemma3_vision")
    model.save_pretrained(path)
    return model, path


def test_gemma3_tower_equals_transformers(gemma3, kernel_path):
    model, path = gemma3
    tower = load_tower(gemma3_vision, path)
    pixels = np.random.default_rng(0).uniform(-1, 1, (2, 3, 56, 56)).astype(np.float32)
    with torch.no_grad():
        expected = model.model.get_image_features(torch.from_numpy(pixels)).pooler_output  # [2, 4, 48]
    both = tower(mx.array(pixels))
    assert both.shape == (8, 48)
    assert max_diff(both, expected.reshape(8, 48)) < ATOL
    for i in range(2):
        alone = tower(mx.array(pixels[i:i + 1]))
        assert max_diff(alone, expected[i]) < ATOL
        assert np.abs(np.array(alone) - np.array(both[4 * i:4 * i + 4])).max() < 1e-5


def test_gemma3_sanitize_accepts_every_layout(gemma3):
    """5.x's vision_tower.* (optionally under model.), 4.x's vision_tower.vision_model.*, a channels-last
    (MLX) patch conv; the text model and SigLIP's unused head are dropped."""
    _, path = gemma3
    tower = load_tower(gemma3_vision, path)
    saved = mx.load(str(path / "model.safetensors"))
    expected = tower.sanitize(saved)
    assert not any(name.startswith("vision_tower.head.") for name in expected)
    older = {name.replace("vision_tower.", "vision_tower.vision_model.", 1): value for name, value in saved.items()}
    prefixed = {f"model.{name}": value for name, value in saved.items()}
    mlx_conv = {name: value.transpose(0, 2, 3, 1) if name.endswith("patch_embedding.weight") else value
                for name, value in saved.items()}
    for layout in (older, prefixed, mlx_conv):
        renamed = tower.sanitize(layout)
        assert renamed.keys() == expected.keys()
        assert all(mx.array_equal(renamed[name], expected[name]) for name in expected)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=12, patch_size=4, pooling_kernel_size=2,
                  position_embedding_size=64, use_clipped_linears=True, standardize=True)
    text = dict(TEXT, global_head_dim=16, hidden_size_per_layer_input=0, layer_types=["sliding_attention", "full_attention"])
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    config._attn_implementation = "eager"
    model = transformers.Gemma4ForConditionalGeneration(config)
    redraw(model)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("std_bias"):
                buffer.normal_(0, 0.5)
            elif name.endswith("std_scale"):
                buffer.uniform_(0.5, 1.5)
            elif name.endswith(("input_min", "output_min")):  # bounds the activations do cross
                buffer.fill_(-1.5)
            elif name.endswith(("input_max", "output_max")):
                buffer.fill_(1.5)
    path = tmp_path_factory.mktemp("gemma4_vision")
    model.save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())  # as Google's configs write it; transformers reads
    saved["vision_config"]["rope_parameters"]["rope_type"] = "default"  # it as "axial"
    (path / "config.json").write_text(json.dumps(saved))
    return model, path


def gemma4_images(sizes: list[tuple[int, int]]) -> dict:
    """Random images (width, height) through transformers' own Gemma 4 image processor (PIL backend)."""
    from PIL import Image

    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in sizes]
    processor = transformers.Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)
    return processor(images, return_tensors="np")


def test_gemma4_tower_equals_transformers(gemma4, kernel_path):
    model, path = gemma4
    tower = load_tower(gemma4_vision, path)
    inputs = gemma4_images([(40, 24), (20, 36)])  # two aspect ratios: different patch counts, padded alike
    pixels, positions = inputs["pixel_values"], inputs["image_position_ids"]
    tokens = list(inputs["num_soft_tokens_per_image"])
    assert pixels.shape == (2, 280, 48) and tokens[0] != tokens[1]
    with torch.no_grad():
        expected = model.model.get_image_features(torch.from_numpy(pixels), torch.from_numpy(positions)).pooler_output
    both = tower(mx.array(pixels), positions)
    assert both.shape == (sum(tokens), 48)
    assert max_diff(both, torch.cat(expected)) < ATOL
    starts = np.cumsum([0, *tokens])
    for i in range(2):
        alone = tower(mx.array(pixels[i:i + 1]), positions[i:i + 1])
        real = int((positions[i] != -1).any(axis=-1).sum())  # unpadded: the real patches come first
        unpadded = tower(mx.array(pixels[i:i + 1, :real]), positions[i:i + 1, :real])
        assert max_diff(alone, expected[i]) < ATOL
        for single in (alone, unpadded):
            assert np.abs(np.array(single) - np.array(both[starts[i]:starts[i + 1]])).max() < 1e-5


def test_gemma4_sanitize_keeps_the_vision_encoder_only(gemma4):
    _, path = gemma4
    tower = load_tower(gemma4_vision, path)
    saved = mx.load(str(path / "model.safetensors"))
    kept = tower.sanitize(saved)
    assert kept and all(name.startswith(("vision_tower.", "embed_vision.")) for name in kept)
    unprefixed = tower.sanitize({name.removeprefix("model."): value for name, value in saved.items()})
    assert unprefixed.keys() == kept.keys()
