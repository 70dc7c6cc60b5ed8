"""Gemma 3 (text): most layers attend over a sliding window, every `sliding_window_pattern`-th globally.

Differences from Qwen2: RMSNorms scale by 1 + w; q/k RMSNorm per head; each block's output is
normed again before the residual add (post-attention, pre- and post-feed-forward norms); the
embedding is scaled by sqrt(hidden) in the activation dtype; GELU-tanh gated MLP; scores scaled
by query_pre_attn_scalar**-0.5; local (sliding) and global layers have their own RoPE bases;
the lm_head is the embedding. model_type `gemma3` nests the text model's config in `text_config`
beside a vision tower (SigLIP + projector: gemma3_vision.py), which `VisionModel` runs: each image is one
`<start_of_image>` in the prompt, expanded to its mm_tokens_per_image tokens and `<end_of_image>` between blank
lines, as transformers' processor writes it; their rows take the tower's output after the embedding's scale,
and at prefill they attend to each other both ways.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tinymlx.core.images import ProcessedImage, PromptImages, expand_placeholders
from tinymlx.core.layer_specs import LayerSpec
from tinymlx.core.pipeline_stage import whole_model
from tinymlx.models import hf_config
from tinymlx.models.base import AttentionBackend, BaseModelArgs, CausalLM, ImageRows
from tinymlx.models.checkpoint import text_model_weights
from tinymlx.models.gemma3_vision import VisionTower
from tinymlx.models.gguf_arch import (
    ATTENTION_TENSORS,
    MLP_TENSORS,
    QK_NORM_TENSORS,
    SANDWICH_NORM_TENSORS,
    GGUFArch,
    Metadata,
    dense_config,
    f32,
)
from tinymlx.models.layers import MLP, Attention, RMSNorm, activation, finish_stage, only_rows
from tinymlx.models.rope import RoPE

_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")
_GGUF_GLOBAL_EVERY = 6  # llama.cpp's gemma3 hard-codes the pattern: five sliding layers, then one global


def _gguf_config(meta: Metadata) -> dict[str, Any]:
    """llama.cpp's gemma3 keys; what it leaves out, it hard-codes (src/llama-model.cpp), and so do we."""
    config = dense_config(meta)
    layers, hidden, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    pattern = meta.get("attention.sliding_window_pattern", _GGUF_GLOBAL_EVERY)
    if isinstance(pattern, list):  # newer files: one flag per layer, true where it slides
        types = [hf_config.SLIDING if slides else hf_config.FULL for slides in pattern]
    else:  # llama.cpp's set_swa_pattern: the last of every `pattern` layers is global (0: none is)
        types = [hf_config.SLIDING if not pattern or (i + 1) % pattern else hf_config.FULL for i in range(layers)]
    if meta.get("attention.scale") is not None:
        scalar = f32(meta.get("attention.scale") ** -2)
    else:  # llama.cpp: 1/sqrt(head_dim), but hidden/heads for the 62-layer 27B (its query_pre_attn_scalar)
        scalar = hidden // heads if layers == 62 else config["head_dim"]
    softcap = meta.get("final_logit_softcapping")
    config.update(
        hidden_act="gelu_pytorch_tanh",
        hidden_activation="gelu_pytorch_tanh",
        sliding_window=meta.need("attention.sliding_window"),
        layer_types=types,
        rope_local_base_freq=f32(meta.get("rope.freq_base_swa", 10_000.0)),
        query_pre_attn_scalar=scalar,
        final_logit_softcapping=None if softcap is None else f32(softcap),
    )
    if not isinstance(pattern, list):
        config["sliding_window_pattern"] = pattern  # what mlx-lm's gemma3_text reads
    return config


GGUF_LAYER_TENSORS = {
    **SANDWICH_NORM_TENSORS,
    **ATTENTION_TENSORS,
    **QK_NORM_TENSORS,
    **MLP_TENSORS,
}
# convert_hf_to_gguf.py adds 1 to every norm weight (Gemma3RMSNorm scales by 1 + w); we keep HF's w.
GGUF_ARCHS = (GGUFArch("gemma3", "Gemma3ForCausalLM", "gemma3_text", GGUF_LAYER_TENSORS, _gguf_config, norm_shift=1.0),)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(BaseModelArgs):
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None  # of the global layers only
    rope_local_base_freq: float = 10_000.0
    query_pre_attn_scalar: float = 256.0
    attention_bias: bool = False
    hidden_activation: str = "gelu_pytorch_tanh"
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    # gemma3 with a vision tower: its whole config.json, and the tokens that mark an image in a prompt
    vision_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    image_token_id: int = 262144
    boi_token_id: int = 255999
    eoi_token_id: int = 256000

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        vision = dict(config) if config.get("vision_config") else {}  # {}: a text model written back (asdict)
        tokens = {name: config[key] for name, key in (("image_token_id", "image_token_index"),
                                                      ("image_token_id", "image_token_id"),
                                                      ("boi_token_id", "boi_token_index"),
                                                      ("eoi_token_id", "eoi_token_index")) if key in config}
        config = config.get("text_config", config)  # gemma3: the text model's part only
        pattern = config.get("sliding_window_pattern", 6)
        types = hf_config.layer_types(config, lambda i: hf_config.SLIDING if (i + 1) % pattern else hf_config.FULL)
        theta, scaling = hf_config.rope_for(config, hf_config.FULL, 1_000_000.0)
        local_theta, local_scaling = hf_config.rope_for(config, hf_config.SLIDING, 10_000.0, "rope_local_base_freq")
        if local_scaling is not None:
            raise ValueError(f"scaled RoPE on the sliding layers ({local_scaling['rope_type']}) is not supported")
        for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if config.get(key):
                raise ValueError(f"{key}={config[key]!r} is not supported")
        return cls(
            model_type="gemma3" if vision else "gemma3_text",
            **hf_config.dense_shape(config),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            rope_local_base_freq=local_theta,
            query_pre_attn_scalar=config.get("query_pre_attn_scalar", 256),
            attention_bias=config.get("attention_bias", False),
            hidden_activation=config.get("hidden_activation", "gelu_pytorch_tanh"),
            final_logit_softcapping=config.get("final_logit_softcapping"),
            max_position_embeddings=config.get("max_position_embeddings", 131_072),
            tie_word_embeddings=config.get("tie_word_embeddings", True),
            layer_types=types,
            sliding_window=hf_config.sliding_window(config, types),
            vision_config=vision,
            **tokens,
        )


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        if args.layer_types[layer] == hf_config.SLIDING:
            rope = RoPE(args.head_dim, args.rope_local_base_freq)
        else:
            rope = RoPE(args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings)

        def norm(dims: int) -> RMSNorm:
            return RMSNorm(dims, args.rms_norm_eps, offset=1.0)

        self.self_attn = Attention(layer, args.hidden_size, args.num_attention_heads, args.num_key_value_heads,
                                   args.head_dim, rope, scale=args.query_pre_attn_scalar**-0.5,
                                   bias=args.attention_bias, out_bias=args.attention_bias, qk_norm=norm)
        self.mlp = MLP(args.hidden_size, args.intermediate_size, activation(args.hidden_activation))
        self.input_layernorm = norm(args.hidden_size)
        self.post_attention_layernorm = norm(args.hidden_size)
        self.pre_feedforward_layernorm = norm(args.hidden_size)
        self.post_feedforward_layernorm = norm(args.hidden_size)

    def __call__(self, x: mx.array, positions: mx.array, attention: AttentionBackend,
                 rows: mx.array | None = None) -> mx.array:
        h = only_rows(x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, attention)),
                      rows)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))

    def shard(self, group: mx.distributed.Group, all_reduce: Callable[[mx.array], mx.array]) -> None:
        self.self_attn.shard(group, all_reduce)
        self.mlp.shard(group, all_reduce)


class Gemma3Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, offset=1.0)
        self.embed_scale = args.hidden_size**0.5
        self.stage = whole_model(args.num_hidden_layers)

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.embed_tokens(tokens)
        return h * mx.array(self.embed_scale, dtype=h.dtype)  # rounded to the activation dtype first, as HF does

    def __call__(self, tokens: mx.array, positions: mx.array, attention: AttentionBackend,
                 rows: mx.array | None = None, embeds: mx.array | None = None) -> mx.array:
        """`embeds`: the tokens' scaled input embeddings where the caller made them (image rows put in, or a
        pipeline stage's input)."""
        h = self.embed(tokens) if embeds is None else embeds
        return finish_stage(self, h, positions, attention, rows)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        if args.sliding_window is None and hf_config.SLIDING in args.layer_types:
            raise ValueError("sliding layers need a sliding_window")
        super().__init__(args)
        self.model = Gemma3Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def logits(self, hidden: mx.array) -> mx.array:
        logits = super().logits(hidden)
        cap = self.args.final_logit_softcapping
        return logits if cap is None else mx.tanh(logits / cap) * cap

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """gemma3 checkpoints hold the text model under language_model (4.x: language_model.model.*,
        5.x: model.language_model.*) beside the vision tower, which is dropped."""
        return super().sanitize(text_model_weights(weights, _NOT_TEXT))


class VisionModel(Model):
    """Gemma 3 with its vision tower (model_type gemma3 with a vision_config)."""

    sees_images = True
    tower_prefixes = ("vision.",)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.vision = VisionTower.from_config(args.vision_config)

    def __call__(self, tokens: mx.array, positions: mx.array, attention: AttentionBackend,
                 rows: mx.array | None = None, images: ImageRows | None = None) -> mx.array:
        embeds = None if images is None else images.placed_in(self.model.embed(tokens))  # after the scale
        return self.model(tokens, positions, attention, rows, embeds)

    def attends_whole_images(self, spec: LayerSpec) -> bool:
        return True

    def encode_images(self, images: list[ProcessedImage]) -> list[mx.array]:
        features = self.vision(mx.array(np.stack([image.pixel_values for image in images])))
        n = self.vision.mm_tokens_per_image
        return [features[i * n:(i + 1) * n] for i in range(len(images))]

    def place_images(self, token_ids: list[int], images: list[ProcessedImage],
                     encode: Callable[[str], list[int]] | None = None) -> tuple[list[int], PromptImages]:
        """Each <start_of_image> the template wrote, followed by the image's tokens and <end_of_image>, with a
        blank line before and after, as transformers' processor writes them (where `encode` is given)."""
        margin = encode("\n\n") if encode is not None else []
        args = self.args
        expanded, spans = expand_placeholders(token_ids, images, args.boi_token_id, args.image_token_id,
                                              margin + [args.boi_token_id], [args.eoi_token_id] + margin)
        return expanded, PromptImages(spans, whole_spans=True)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        tower = {f"vision.{name}": value for name, value in self.vision.sanitize(weights).items()}
        return {**super().sanitize(weights), **tower}
