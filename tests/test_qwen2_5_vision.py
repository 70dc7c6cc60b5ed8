"""Qwen2.5-VL's vision tower against transformers': a tiny random checkpoint written by transformers, loaded
through `sanitize`, must give the merged tokens HF's tower gives (its pooler_output, what the LM reads)
for grids whose windows are cut at the edges, several images in one call, videos and one-window images,
through every kernel path (the gated MLP's activation is the chosen kernels')."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tinymlx.models.qwen2_5_vision import VisionTower  # noqa: E402

TOLERANCE = 1e-4
PATCH_VALUES = 3 * 2 * 14 * 14  # channels * temporal_patch_size * patch_size^2
# window_size 56 px = 2 x 2 merge units (4 x 4 patches); blocks 1 and 3 attend over whole frames.
VISION = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              fullatt_block_indexes=[1, 3], window_size=56, patch_size=14, spatial_merge_size=2,
              temporal_patch_size=2)
TEXT = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(HF model, our tower loaded from its saved checkpoint). Weights are redrawn with std 0.2 (norms
    around 1) so every term moves the output well past the tolerance."""
    torch.manual_seed(0)
    config = transformers.Qwen2_5_VLConfig(text_config=TEXT, vision_config=VISION)
    config._attn_implementation = "eager"
    config.vision_config._attn_implementation = "eager"
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.normal_(0.0, 0.2)
            if "norm" in name or "ln_q" in name:
                parameter.add_(1.0)
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    model.save_pretrained(path)
    tower = VisionTower.from_config(json.loads((path / "config.json").read_text()))
    tower.load_weights(list(tower.sanitize(mx.load(str(path / "model.safetensors"))).items()), strict=True)
    return model, tower


def random_pixels(grids: list[tuple[int, int, int]], seed: int = 0) -> np.ndarray:
    num_patches = sum(t * h * w for t, h, w in grids)
    return np.random.default_rng(seed).standard_normal((num_patches, PATCH_VALUES)).astype(np.float32)


def hf_tokens(model, pixels: np.ndarray, grids: list[tuple[int, int, int]]) -> np.ndarray:
    with torch.no_grad():
        out = model.model.visual(torch.from_numpy(pixels), grid_thw=torch.tensor(grids))
    return out.pooler_output.numpy()


def our_tokens(tower: VisionTower, pixels: np.ndarray, grids: list[tuple[int, int, int]]) -> np.ndarray:
    return np.array(tower(mx.array(pixels), grids))


@pytest.mark.parametrize("grids", [
    pytest.param([(1, 10, 14)], id="windows-cut-at-edges"),     # 5 x 7 units: 2 x 2-unit windows don't fit
    pytest.param([(1, 4, 4)], id="one-window"),
    pytest.param([(1, 2, 2)], id="one-token"),
    pytest.param([(2, 4, 6)], id="two-frames"),                 # a video: frames never attend to each other
])
def test_tokens_equal_transformers(checkpoint, grids, kernel_path):
    model, tower = checkpoint
    pixels = random_pixels(grids)
    expected = hf_tokens(model, pixels, grids)
    ours = our_tokens(tower, pixels, grids)
    assert ours.shape == (sum(t * h * w for t, h, w in grids) // 4, VISION["out_hidden_size"])
    np.testing.assert_allclose(ours, expected, atol=TOLERANCE, rtol=0)


def test_images_in_one_call_equal_transformers_and_each_alone(checkpoint, kernel_path):
    model, tower = checkpoint
    grids = [(1, 10, 14), (1, 6, 8)]
    pixels = random_pixels(grids)
    together = our_tokens(tower, pixels, grids)
    np.testing.assert_allclose(together, hf_tokens(model, pixels, grids), atol=TOLERANCE, rtol=0)
    first_patches, first_tokens = 10 * 14, 10 * 14 // 4
    np.testing.assert_allclose(together[:first_tokens], our_tokens(tower, pixels[:first_patches], grids[:1]),
                               atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(together[first_tokens:], our_tokens(tower, pixels[first_patches:], grids[1:]),
                               atol=TOLERANCE, rtol=0)


def test_bfloat16_tower_stays_close(checkpoint):
    model, tower = checkpoint
    grids = [(1, 10, 14)]
    pixels = random_pixels(grids)
    expected = hf_tokens(model, pixels, grids)
    half = VisionTower(tower.args)
    half.update(tower.parameters())
    half.set_dtype(mx.bfloat16)
    ours = half(mx.array(pixels), grids)
    assert ours.dtype == mx.bfloat16
    error = np.abs(np.array(ours.astype(mx.float32)) - expected)
    assert error.mean() < 0.02 * np.abs(expected).mean()


def test_sanitize_keeps_only_the_tower_and_accepts_both_prefixes(checkpoint):
    _, tower = checkpoint
    conv = mx.zeros((32, 3, 2, 14, 14))
    weights = {"visual.patch_embed.proj.weight": conv, "model.visual.blocks.0.norm1.weight": mx.ones((32,)),
               "model.language_model.layers.0.mlp.up_proj.weight": mx.zeros((4, 4)), "lm_head.weight": mx.zeros((4,))}
    assert {name: w.shape for name, w in tower.sanitize(weights).items()} == {
        "patch_embed.proj.weight": (32, PATCH_VALUES), "blocks.0.norm1.weight": (32,)}


def test_grid_that_does_not_merge_is_refused(checkpoint):
    _, tower = checkpoint
    with pytest.raises(ValueError, match="multiples of 2"):
        tower(mx.zeros((3 * 4, PATCH_VALUES)), [(1, 3, 4)])
