"""Qwen3.5 and Qwen3.5-MoE with their vision tower (model_type qwen3_5, qwen3_5_moe): qwen3_5.py's hybrid
text model beside Qwen3's ViT without DeepStack (qwen3_vision.py), whose merged patches take the place of the
prompt's image placeholder tokens.

Only the gated-attention layers read positions: they rotate the first partial_rotary_factor of each head by
interleaved multimodal RoPE (rope.MRoPE), which on a text-only step ([N] positions) is qwen3_5's plain RoPE.
The Gated DeltaNet layers see image tokens as any others. Images are placed and encoded as Qwen3-VL's
(qwen3_vl.QwenImages): transformers' get_rope_index is the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from tinymlx.models import qwen3_5
from tinymlx.models.base import AttentionBackend, ImageRows
from tinymlx.models.qwen3_vision import VisionTower
from tinymlx.models.qwen3_vl import QwenImages, vision_fields
from tinymlx.models.rope import MRoPE


@dataclass(frozen=True, kw_only=True)
class ModelArgs(qwen3_5.ModelArgs):
    mrope_section: tuple[int, ...] = (11, 11, 10)
    image_token_id: int = 151655
    spatial_merge_size: int = 2
    vision_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        text = qwen3_5.ModelArgs.from_config(config)
        if text.rope_scaling is not None:
            raise ValueError(f"multimodal RoPE with {text.rope_scaling['rope_type']!r} scaling is not supported")
        return cls(**vars(text), **vision_fields(config, cls.mrope_section))


class Model(QwenImages, qwen3_5.Model):
    def __init__(self, args: ModelArgs):
        rotary_dims = int(args.head_dim * args.partial_rotary_factor)
        super().__init__(args, MRoPE(rotary_dims, args.rope_theta, args.mrope_section, interleaved=True,
                                     head_dim=args.head_dim))
        self.visual = VisionTower.from_config(args.vision_config)

    def __call__(self, tokens: mx.array, positions: mx.array, attention: AttentionBackend,
                 rows: mx.array | None = None, images: ImageRows | None = None) -> mx.array:
        embeds = None if images is None else images.placed_in(self.model.embed_tokens(tokens))
        return self.model(tokens, positions, attention, rows, embeds)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return {**super().sanitize(weights), **self.tower_weights(weights)}
