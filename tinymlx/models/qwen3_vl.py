"""Qwen3-VL and Qwen3-VL-MoE: Qwen3's decoder (with qwen3_moe's sparse MLPs in the MoE variant) rotating by
interleaved multimodal RoPE, beside Qwen3's ViT (qwen3_vision.py), whose merged patches take the place of the
prompt's image placeholder tokens and whose DeepStack levels join those tokens after the first layers:

    image rows [M, hidden * (1 + L)] = merger | level 0 | ... | level L-1   (one array per image, cached as one)
    h = embed(tokens); h[image rows] = merger
    after decoder layer i < L:  h[image rows] += level i

A chunk covering part of an image gets the matching rows of every level (the runner slices the cached array).
Images are placed and encoded as Qwen2.5-VL's (qwen2_5_vl.py): transformers' Qwen3-VL get_rope_index differs
only for video, whose frames it splits. `QwenImages` is what Qwen3.5's vision-language model (qwen3_5_vl.py)
shares with this one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from tinymlx.models import qwen2, qwen2_5_vl, qwen3, qwen3_moe
from tinymlx.models.base import AttentionBackend, CausalLM, ImageRows
from tinymlx.models.checkpoint import text_model_weights
from tinymlx.models.layers import MLP, activation, only_rows
from tinymlx.models.moe import SparseMoE, stack_experts
from tinymlx.models.qwen3_vision import VisionTower
from tinymlx.models.rope import MRoPE

_NOT_TEXT = ("model.visual.", "visual.", "vision_tower.")


def vision_fields(config: dict[str, Any], default_sections: tuple[int, ...]) -> dict[str, Any]:
    """What a Qwen3-family vision-language config.json adds to its text model's arguments (transformers 5.x
    keeps the M-RoPE layout in text_config.rope_parameters, 4.x in rope_scaling)."""
    text = config.get("text_config", config)
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    return dict(mrope_section=tuple(rope.get("mrope_section", default_sections)),
                image_token_id=config.get("image_token_id", 151655),
                spatial_merge_size=config["vision_config"].get("spatial_merge_size", 2), vision_config=dict(config))


class QwenImages:
    """A text model with Qwen3's vision tower at `self.visual`: it sees images, places them (M-RoPE positions)
    and encodes them as Qwen2.5-VL does."""

    sees_images = True
    has_multimodal_rope = True
    tower_prefixes = ("visual.",)
    place_images = qwen2_5_vl.Model.place_images
    encode_images = qwen2_5_vl.Model.encode_images

    def tower_weights(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return {f"visual.{name}": value for name, value in self.visual.sanitize(weights).items()}


@dataclass(frozen=True, kw_only=True)
class ModelArgs(qwen3_moe.ModelArgs):
    """Qwen3-MoE's arguments with no experts for the dense Qwen3-VL, plus the vision ones."""

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # Qwen3-VL-MoE's router always renormalizes its top k
    mrope_section: tuple[int, ...] = (24, 20, 20)
    image_token_id: int = 151655
    spatial_merge_size: int = 2
    vision_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        nested = config.get("text_config", {})
        tied = config.get("tie_word_embeddings", nested.get("tie_word_embeddings", False))
        text = {**config, **nested, "model_type": config["model_type"], "tie_word_embeddings": tied}
        dense = qwen3.ModelArgs.from_config(text)
        if dense.rope_scaling is not None:
            raise ValueError(f"multimodal RoPE with {dense.rope_scaling['rope_type']!r} scaling is not supported")
        num_experts = text.get("num_experts", text.get("num_local_experts", 0))
        return cls(**vars(dense), num_experts=num_experts, num_experts_per_tok=text.get("num_experts_per_tok", 0),
                   moe_intermediate_size=text.get("moe_intermediate_size", 0),
                   decoder_sparse_step=text.get("decoder_sparse_step", 1),
                   mlp_only_layers=tuple(text.get("mlp_only_layers") or ()),
                   **vision_fields(config, cls.mrope_section))

    def ffn_widths(self) -> dict[str, int]:
        return super().ffn_widths() if self.num_experts else {"down_proj": self.intermediate_size}


class Model(QwenImages, CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        rope = MRoPE(args.head_dim, args.rope_theta, args.mrope_section, interleaved=True)
        act = activation(args.hidden_act)

        def mlp(layer: int) -> nn.Module:
            if args.is_sparse(layer):
                return SparseMoE(args.hidden_size, args.moe_intermediate_size, args.num_experts,
                                 args.num_experts_per_tok, args.norm_topk_prob, act)
            return MLP(args.hidden_size, args.intermediate_size, act)

        layers = [qwen2.DecoderLayer(args, i, mlp(i), qk_norm=True, rope=rope) for i in range(args.num_hidden_layers)]
        self.model = qwen2.Qwen2Model(args, layers)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.visual = VisionTower.from_config(args.vision_config)

    def __call__(self, tokens: mx.array, positions: mx.array, attention: AttentionBackend,
                 rows: mx.array | None = None, images: ImageRows | None = None) -> mx.array:
        if images is None:
            return self.model(tokens, positions, attention, rows)
        merged, *levels = mx.split(images.features, 1 + self.visual.num_deepstack_levels, axis=-1)
        h = images._replace(features=merged).placed_in(self.model.embed_tokens(tokens))
        layers = self.model.layers
        for i, layer in enumerate(layers):
            # Only the last layer narrows to `rows`, and only once no DeepStack level is left to add.
            narrows = i == len(layers) - 1 and i >= len(levels)
            h = layer(h, positions, attention, rows if narrows else None)
            if i < len(levels):
                h = h.at[images.rows].add(levels[i].astype(h.dtype))
        if len(levels) >= len(layers):
            h = only_rows(h, rows)
        return self.model.norm(h)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        text = text_model_weights(weights, _NOT_TEXT)
        if self.args.num_experts:
            text = stack_experts(self._experts_as_linears(text), self.args.num_experts)
        return {**super().sanitize(text), **self.tower_weights(weights)}

    def _experts_as_linears(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The Hub's Qwen3-VL-MoE stores packed experts input-major (gate_up_proj [E, D, 2I], down_proj
        [E, I, D]); transformers 5.x saves them as its modules hold them, [E, 2I, D] and [E, D, I]. Like
        transformers, transpose where the last axis is not the linear's input width."""
        inputs = {".mlp.experts.gate_up_proj": self.args.hidden_size,
                  ".mlp.experts.down_proj": self.args.moe_intermediate_size}
        out = {}
        for name, value in weights.items():
            width = next((w for suffix, w in inputs.items() if name.endswith(suffix)), None)
            out[name] = value.swapaxes(1, 2) if width is not None and value.shape[-1] != width else value
        return out

