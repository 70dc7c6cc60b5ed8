"""Qwen2.5-VL: Qwen2's decoder with multimodal RoPE, beside a windowed ViT (qwen2_5_vision.py) whose merged
patches take the place of the prompt's image placeholder tokens.

A prompt names each image with one `<|image_pad|>` (between `<|vision_start|>` and `<|vision_end|>`, as the
chat template writes it); `place_images` expands it to the image's t * h * w / merge**2 tokens and gives
every token its (temporal, height, width) position, as transformers' get_rope_index does: text advances all
three by one, an image's tokens share the temporal one and walk its rows and columns, and the text after it
resumes past the image's larger side. Tokens after the prompt are at their position + `rope_delta`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tinymlx.core.images import ProcessedImage, PromptImages, expand_placeholders
from tinymlx.models import qwen2
from tinymlx.models.base import AttentionBackend, CausalLM, ImageRows
from tinymlx.models.layers import MLP, activation
from tinymlx.models.qwen2_5_vision import VisionTower
from tinymlx.models.rope import MRoPE


@dataclass(frozen=True, kw_only=True)
class ModelArgs(qwen2.ModelArgs):
    mrope_section: tuple[int, ...] = ()
    image_token_id: int = 151655
    spatial_merge_size: int = 2
    vision_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        """transformers 5.x nests the text model's keys in text_config; 4.x keeps them at the top."""
        text = {**config, **config.get("text_config", {}), "model_type": config["model_type"]}
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if "mrope_section" not in rope:
            raise KeyError("mrope_section")
        plain = {k: v for k, v in text.items() if k != "rope_scaling"}
        if "rope_parameters" in plain:  # the M-RoPE layout is no scaling of the frequencies
            plain["rope_parameters"] = {"rope_theta": rope.get("rope_theta", 1000000.0)}
        plain.setdefault("rope_theta", rope.get("rope_theta", text.get("rope_theta", 1000000.0)))
        plain.setdefault("attention_bias", True)  # Qwen2's q/k/v bias
        base = qwen2.ModelArgs.from_config(plain)
        vision = config["vision_config"]
        return cls(**{f: getattr(base, f) for f in base.__dataclass_fields__},
                   mrope_section=tuple(rope["mrope_section"]), image_token_id=config.get("image_token_id", 151655),
                   spatial_merge_size=vision.get("spatial_merge_size", 2), vision_config=dict(config))


class Model(CausalLM):
    sees_images = True
    has_multimodal_rope = True
    tower_prefixes = ("visual.",)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        rope = MRoPE(args.head_dim, args.rope_theta, args.mrope_section)
        act = activation(args.hidden_act)
        layers = [qwen2.DecoderLayer(args, i, MLP(args.hidden_size, args.intermediate_size, act), rope=rope)
                  for i in range(args.num_hidden_layers)]
        self.model = qwen2.Qwen2Model(args, layers)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.visual = VisionTower.from_config(args.vision_config)

    def __call__(self, tokens: mx.array, positions: mx.array, attention: AttentionBackend,
                 rows: mx.array | None = None, images: ImageRows | None = None) -> mx.array:
        embeds = None if images is None else images.placed_in(self.model.embed_tokens(tokens))
        return self.model(tokens, positions, attention, rows, embeds)

    def encode_images(self, images: list[ProcessedImage]) -> list[mx.array]:
        pixels = mx.array(np.concatenate([image.pixel_values for image in images]))
        features = self.visual(pixels, [image.grid_thw for image in images])
        ends = np.cumsum([image.num_tokens for image in images])
        return [features[end - image.num_tokens:end] for image, end in zip(images, ends)]

    def place_images(self, token_ids: list[int], images: list[ProcessedImage],
                     encode: Callable[[str], list[int]] | None = None) -> tuple[list[int], PromptImages]:
        placeholder = self.args.image_token_id
        expanded, spans = expand_placeholders(token_ids, images, placeholder, placeholder, [], [])
        merge, positions, previous_end, position = self.args.spatial_merge_size, [], 0, 0
        for span in (*spans, None):  # the text before each image, the image; the text after the last
            text_end = len(expanded) if span is None else span.start
            positions.append(np.broadcast_to(np.arange(position, position + text_end - previous_end),
                                             (3, text_end - previous_end)))
            position += text_end - previous_end
            if span is None:
                break
            t, h, w = span.image.grid_thw
            grid = np.stack(np.meshgrid(np.arange(t), np.arange(h // merge), np.arange(w // merge), indexing="ij"))
            positions.append(grid.reshape(3, -1) + position)
            position += max(h, w) // merge
            previous_end = span.end
        rope = np.concatenate(positions, axis=1).astype(np.int32)
        return expanded, PromptImages(spans, rope, int(rope.max()) + 1 - len(expanded))

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        tower = {f"visual.{name}": value for name, value in self.visual.sanitize(weights).items()}
        text = {name: value for name, value in weights.items() if not name.startswith(("visual.", "model.visual."))}
        return {**super().sanitize(_text_names(text)), **tower}


def _text_names(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """transformers 5.x's in-memory names (model.language_model.*) as the checkpoint's (model.*)."""
    return {name.replace("model.language_model.", "model.", 1): value for name, value in weights.items()}
