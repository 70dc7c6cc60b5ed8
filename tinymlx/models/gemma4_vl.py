"""Gemma 4 with its vision encoder (model_type gemma4 with a vision_config): gemma4.py's text model beside
gemma4_vision.py's tower, as transformers' Gemma4ForConditionalGeneration runs them.

    prompt: one image token per image (the chat template's)  --place_images-->
            <boi> + num_soft_tokens image tokens + <eoi>, each image's count from its patch grid
    step:   the image tokens' rows of the scaled input embeddings take the tower's rows (themselves unscaled);
            the per-layer inputs (E2B/E4B) look up the pad id at those rows, and project the merged rows
    mask:   with text_config.use_bidirectional_attention == "vision", an image's tokens see each other both
            ways in the sliding layers (within the window, as any key); the global layers stay causal

A config without a vision_config loads the text model alone; the audio tower is never loaded (no audio in).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from tinymlx.core.images import ProcessedImage, PromptImages, expand_placeholders
from tinymlx.core.layer_specs import LayerSpec, SlidingWindow
from tinymlx.models import gemma4
from tinymlx.models.base import AttentionBackend, ImageRows
from tinymlx.models.gemma4_vision import VisionTower
from tinymlx.vision.gemma_processor import gemma4_position_ids


@dataclass(frozen=True, kw_only=True)
class ModelArgs(gemma4.ModelArgs):
    vision_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)  # the whole config.json
    image_token_id: int = 258_880
    boi_token_id: int = 255_999
    eoi_token_id: int = 258_882
    pad_token_id: int = 0  # what the per-layer embedding reads at an image's tokens
    sees_images_both_ways: bool = False  # use_bidirectional_attention == "vision"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> gemma4.ModelArgs:
        text = gemma4.ModelArgs.from_config(config)
        if config.get("model_type") != "gemma4" or not config.get("vision_config"):
            return text  # no vision encoder: the text model (model_type gemma4_text) alone
        text_config = config["text_config"]
        tokens = {key: config[key] for key in ("image_token_id", "boi_token_id", "eoi_token_id")
                  if config.get(key) is not None}
        return cls(**{**vars(text), "model_type": "gemma4"}, vision_config=dict(config),
                   pad_token_id=text_config.get("pad_token_id") or 0,
                   sees_images_both_ways=text_config.get("use_bidirectional_attention") == "vision", **tokens)


class Model(gemma4.Model):
    sees_images = True
    tower_prefixes = ("vision.",)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision = VisionTower.from_config(args.vision_config)

    def __call__(self, tokens: mx.array, positions: mx.array, attention: AttentionBackend,
                 rows: mx.array | None = None, images: ImageRows | None = None) -> mx.array:
        if images is None:
            return self.model(tokens, positions, attention, rows)
        embeds = images.placed_in(self.model.embed(tokens))  # after the scale
        # transformers swaps every image token for the pad id before the per-layer lookup
        per_layer_tokens = mx.where(tokens == self.args.image_token_id, self.args.pad_token_id, tokens)
        return self.model(tokens, positions, attention, rows, embeds, per_layer_tokens)

    def attends_whole_images(self, spec: LayerSpec) -> bool:
        return self.args.sees_images_both_ways and isinstance(spec, SlidingWindow)

    def encode_images(self, images: list[ProcessedImage]) -> list[mx.array]:
        """One run of the tower per patch grid: images of one size batch without padding."""
        by_grid: dict[tuple[int, int, int], list[int]] = {}
        for i, image in enumerate(images):
            by_grid.setdefault(image.grid_thw, []).append(i)
        features: list[mx.array | None] = [None] * len(images)
        for grid, members in by_grid.items():
            pixels = np.stack([images[i].pixel_values for i in members])
            positions = np.broadcast_to(gemma4_position_ids(grid), (len(members), pixels.shape[1], 2))
            out = self.vision(pixels, positions)
            n = images[members[0]].num_tokens
            for j, i in enumerate(members):
                features[i] = out[j * n:(j + 1) * n]
        return features

    def place_images(self, token_ids: list[int], images: list[ProcessedImage],
                     encode: Callable[[str], list[int]] | None = None) -> tuple[list[int], PromptImages]:
        """Each image token the template wrote, as <boi>, the image's tokens and <eoi> (transformers' processor)."""
        args = self.args
        expanded, spans = expand_placeholders(token_ids, images, args.image_token_id, args.image_token_id,
                                              [args.boi_token_id], [args.eoi_token_id])
        return expanded, PromptImages(spans, whole_spans=args.sees_images_both_ways)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        tower = {f"vision.{name}": value for name, value in self.vision.sanitize(weights).items()}
        return {**super().sanitize(weights), **tower}
