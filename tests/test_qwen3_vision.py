"""The Qwen3-VL / Qwen3.5 vision tower against Hugging Face's: tiny random checkpoints saved by
transformers, loaded through `sanitize`, compared on the merger's output and every DeepStack level."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from mlx.utils import tree_flatten
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForConditionalGeneration,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

from tinymlx.models.qwen3_vision import VisionTower

# Float32 on both sides agrees to ~1e-6; 2e-5 still tells the blocks' tanh GELU from the exact one (6e-5 apart).
TOLERANCE = 2e-5
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=64)  # an 8 x 8 position table
TEXT = dict(vocab_size=128, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16)
QWEN3_5_TEXT = dict(TEXT, layer_types=["linear_attention", "full_attention"], linear_conv_kernel_dim=4,
                    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=2)
PATCH_DIM = 3 * 2 * 4 * 4
ODD_GRID = (1, 6, 10)  # 6 x 10 patches: a non-square grid, resampled from the 8 x 8 table both ways


def _save_random(model: torch.nn.Module, path: Path) -> Path:
    """Every parameter redrawn from N(0, 0.2), so no term (biases, norms, positions) is near zero or one."""
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.2)
    model.eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["qwen3_vl", "qwen3_5"])
def checkpoint(request, tmp_path_factory) -> tuple[torch.nn.Module, VisionTower]:
    """(Hugging Face's visual model, our tower loaded from the same saved checkpoint)."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3_vl":
        config = Qwen3VLConfig(vision_config=dict(VISION, deepstack_visual_indexes=[0, 1]), text_config=TEXT)
        model = Qwen3VLForConditionalGeneration(config)
    else:
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(vision_config=VISION, text_config=QWEN3_5_TEXT))
    _save_random(model, path)
    tower = VisionTower.from_config(json.loads((path / "config.json").read_text()))
    tower.load_weights(list(tower.sanitize(mx.load(str(path / "model.safetensors"))).items()), strict=True)
    return model.model.visual, tower


def _pixels(grids: list[tuple[int, int, int]], seed: int = 0) -> np.ndarray:
    patches = sum(t * h * w for t, h, w in grids)
    return np.random.default_rng(seed).standard_normal((patches, PATCH_DIM), dtype=np.float32)


def _hf_levels(visual: torch.nn.Module, pixels: np.ndarray, grids: list[tuple[int, int, int]]) -> list[np.ndarray]:
    """Hugging Face's merger output, then each DeepStack level's (Qwen3.5's tower has none)."""
    with torch.no_grad():
        out = visual(torch.from_numpy(pixels), grid_thw=torch.tensor(grids))
    return [t.numpy() for t in (out.pooler_output, *(getattr(out, "deepstack_features", None) or []))]


def _max_errors(visual: torch.nn.Module, tower: VisionTower, grids: list[tuple[int, int, int]]) -> list[float]:
    pixels = _pixels(grids)
    expected = _hf_levels(visual, pixels, grids)
    ours = np.array(tower(mx.array(pixels), grids))
    assert len(expected) == 1 + tower.num_deepstack_levels
    assert ours.shape == (expected[0].shape[0], sum(level.shape[1] for level in expected))
    levels = np.split(ours, len(expected), axis=-1)
    return [float(np.abs(mine - theirs).max()) for mine, theirs in zip(levels, expected)]


def test_one_image_with_an_odd_grid_matches_hf(checkpoint, kernel_path):
    visual, tower = checkpoint
    assert max(_max_errors(visual, tower, [ODD_GRID])) < TOLERANCE


def test_two_images_in_one_call_match_hf_and_each_alone(checkpoint):
    """Attention never crosses images: each image's rows are what it gives alone."""
    visual, tower = checkpoint
    grids = [ODD_GRID, (1, 4, 8)]
    assert max(_max_errors(visual, tower, grids)) < TOLERANCE
    pixels = _pixels(grids)
    together = np.array(tower(mx.array(pixels), grids))
    first_patches, first_tokens = 6 * 10, 6 * 10 // 4
    alone = [np.array(tower(mx.array(pixels[:first_patches]), grids[:1])),
             np.array(tower(mx.array(pixels[first_patches:]), grids[1:]))]
    np.testing.assert_allclose(together[:first_tokens], alone[0], atol=1e-5)
    np.testing.assert_allclose(together[first_tokens:], alone[1], atol=1e-5)


def test_frames_of_a_video_attend_within_themselves_as_hf(checkpoint):
    visual, tower = checkpoint
    assert max(_max_errors(visual, tower, [(2, 4, 6), (1, 2, 2)])) < TOLERANCE


def test_deepstack_only_where_hf_has_it():
    vision = dict(VISION, deepstack_visual_indexes=[0, 1])
    assert VisionTower.from_config({"model_type": "qwen3_vl_moe", "vision_config": vision}).num_deepstack_levels == 2
    # Hugging Face's Qwen3.5 tower has no DeepStack mergers, whatever its config carries.
    assert VisionTower.from_config({"model_type": "qwen3_5_moe", "vision_config": vision}).num_deepstack_levels == 0


def test_sanitize_takes_every_prefix_and_conv_layout(checkpoint):
    """`model.visual.*` (transformers 5), `visual.*` (older checkpoints), `vision_tower.*` with a channels-last
    Conv3d (mlx-vlm) all give the same tower weights; text and other tensors are dropped."""
    _, tower = checkpoint
    hf = {f"model.visual.{name}": value for name, value in _as_hf(tower).items()}
    hf["model.language_model.embed_tokens.weight"] = mx.zeros((4, 4))
    expected = tower.sanitize(hf)
    assert set(expected) == {name for name, _ in _flat(tower)}
    older = {name.replace("model.visual.", "visual.", 1): value for name, value in hf.items()}
    mlx_vlm = {name.replace("model.visual.", "vision_tower.", 1): value.moveaxis(1, -1) if value.ndim == 5 else value
               for name, value in hf.items()}
    for weights in (older, mlx_vlm):
        got = tower.sanitize(weights)
        assert set(got) == set(expected)
        assert all(mx.array_equal(got[name], expected[name]) for name in expected)


def _flat(tower: VisionTower) -> list[tuple[str, mx.array]]:
    return tree_flatten(tower.parameters())


def _as_hf(tower: VisionTower) -> dict[str, mx.array]:
    """The tower's weights as Hugging Face stores them: the patch matmul back as a Conv3d [out, C, T, p, p]."""
    weights = dict(_flat(tower))
    weights["patch_embed.proj.weight"] = weights["patch_embed.proj.weight"].reshape(-1, 3, 2, 4, 4)
    return weights
