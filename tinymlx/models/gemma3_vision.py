"""Gemma 3's vision tower: SigLIP over a fixed-size image, then the multimodal projector into the text model.

    pixel_values [B, 3, S, S]  --patch conv + learned positions-->  [B, (S/p)^2, D]
      --pre-LayerNorm encoder blocks (GELU-tanh MLP), post LayerNorm-->  [B, (S/p)^2, D]
      --average pool to mm_tokens_per_image, RMSNorm (1 + w), @ projection-->  [B * mm_tokens, text hidden]

The rows replace the image's placeholder tokens after the text embedding's sqrt(hidden) scale: they are
never scaled themselves (transformers' Gemma3Model masked_scatters them into the scaled inputs_embeds).
At prefill each image's tokens also see each other both ways, in every layer.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from tinymlx.models.layers import RMSNorm
from tinymlx.ops import kernels

_PREFIXES = ("vision_tower.", "multi_modal_projector.")
_UNUSED = ("vision_tower.head.",)  # SigLIP's attention-pooling head: Gemma 3 reads the last hidden state
# SiglipVisionConfig's defaults, for a config.json that leaves them out
_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                 num_channels=3, image_size=224, patch_size=16, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")


class SiglipAttention(nn.Module):
    def __init__(self, dims: int, num_heads: int):
        super().__init__()
        self.num_heads, self.scale = num_heads, (dims // num_heads) ** -0.5
        self.q_proj = nn.Linear(dims, dims)
        self.k_proj = nn.Linear(dims, dims)
        self.v_proj = nn.Linear(dims, dims)
        self.out_proj = nn.Linear(dims, dims)

    def __call__(self, x: mx.array) -> mx.array:
        B, L, D = x.shape

        def heads(h: mx.array) -> mx.array:
            return h.reshape(B, L, self.num_heads, -1).transpose(0, 2, 1, 3)

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        out = kernels.dense_attention(q, k, v, self.scale)  # every patch sees every patch
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(B, L, D))


class SiglipMLP(nn.Module):
    def __init__(self, dims: int, hidden_dims: int):
        super().__init__()
        self.fc1 = nn.Linear(dims, hidden_dims)
        self.fc2 = nn.Linear(hidden_dims, dims)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc2(nn.gelu_approx(self.fc1(x)))  # gelu_pytorch_tanh


class SiglipEncoderLayer(nn.Module):
    def __init__(self, dims: int, hidden_dims: int, num_heads: int, eps: float):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(dims, eps=eps)
        self.self_attn = SiglipAttention(dims, num_heads)
        self.layer_norm2 = nn.LayerNorm(dims, eps=eps)
        self.mlp = SiglipMLP(dims, hidden_dims)

    def __call__(self, x: mx.array) -> mx.array:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.layers = [SiglipEncoderLayer(config["hidden_size"], config["intermediate_size"],
                                          config["num_attention_heads"], config["layer_norm_eps"])
                       for _ in range(config["num_hidden_layers"])]

    def __call__(self, x: mx.array) -> mx.array:
        for layer in self.layers:
            x = layer(x)
        return x


class SiglipEmbeddings(nn.Module):
    """Each patch_size x patch_size patch through one conv (MLX's channels-last layout), plus a learned
    embedding per patch position (row-major)."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        dims, patch = config["hidden_size"], config["patch_size"]
        self.patch_embedding = nn.Conv2d(config["num_channels"], dims, kernel_size=patch, stride=patch)
        self.position_embedding = nn.Embedding((config["image_size"] // patch) ** 2, dims)

    def __call__(self, pixel_values: mx.array) -> mx.array:
        pixels = pixel_values.transpose(0, 2, 3, 1).astype(self.patch_embedding.weight.dtype)
        patches = self.patch_embedding(pixels)  # [B, S/p, S/p, D]
        B, rows, cols, D = patches.shape
        return patches.reshape(B, rows * cols, D) + self.position_embedding.weight


class SiglipVisionModel(nn.Module):
    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.embeddings = SiglipEmbeddings(config)
        self.encoder = SiglipEncoder(config)
        self.post_layernorm = nn.LayerNorm(config["hidden_size"], eps=config["layer_norm_eps"])

    def __call__(self, pixel_values: mx.array) -> mx.array:
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))


class MultiModalProjector(nn.Module):
    """The patch grid averaged in k x k squares down to mm_tokens_per_image, RMSNormed, projected to the text
    model's width (a plain [vision, text] matrix, as the checkpoint stores it)."""

    def __init__(self, vision: dict[str, Any], text_hidden_size: int, mm_tokens_per_image: int):
        super().__init__()
        self.patches_per_side = vision["image_size"] // vision["patch_size"]
        self.tokens_per_side = math.isqrt(mm_tokens_per_image)
        if self.tokens_per_side**2 != mm_tokens_per_image or self.patches_per_side % self.tokens_per_side:
            raise ValueError(f"mm_tokens_per_image={mm_tokens_per_image} is not a square dividing the "
                             f"{self.patches_per_side} x {self.patches_per_side} patch grid")
        self.mm_soft_emb_norm = RMSNorm(vision["hidden_size"], vision["layer_norm_eps"], offset=1.0)
        self.mm_input_projection_weight = mx.zeros((vision["hidden_size"], text_hidden_size))

    def __call__(self, x: mx.array) -> mx.array:
        B, _, D = x.shape
        side, k = self.tokens_per_side, self.patches_per_side // self.tokens_per_side
        pooled = x.reshape(B, side, k, side, k, D).mean(axis=(2, 4)).reshape(B, side * side, D)
        return self.mm_soft_emb_norm(pooled) @ self.mm_input_projection_weight


class VisionTower(nn.Module):
    """SigLIP + Gemma 3's projector; `pixel_values` [B, 3, S, S] as transformers' Gemma3ImageProcessor makes
    them (resized to image_size, normalized to [-1, 1]); returns [B * mm_tokens_per_image, text hidden],
    each image's rows in order (pooled rows in row-major order of the pooled grid)."""

    def __init__(self, vision: dict[str, Any], text_hidden_size: int, mm_tokens_per_image: int):
        super().__init__()
        self.mm_tokens_per_image = mm_tokens_per_image
        self.vision_tower = SiglipVisionModel(vision)
        self.multi_modal_projector = MultiModalProjector(vision, text_hidden_size, mm_tokens_per_image)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionTower:
        """From a gemma3 checkpoint's whole config.json."""
        if config.get("vision_config") is None:
            raise ValueError("this gemma3 config has no vision_config: the checkpoint has no vision tower")
        vision = {**_DEFAULTS, **config["vision_config"]}
        if vision["hidden_act"] not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"vision hidden_act {vision['hidden_act']!r} is not supported")
        return cls(vision, config["text_config"]["hidden_size"], config.get("mm_tokens_per_image", 256))

    def __call__(self, pixel_values: mx.array) -> mx.array:
        features = self.multi_modal_projector(self.vision_tower(pixel_values))
        return features.reshape(-1, features.shape[-1])

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The tower's and projector's tensors from all of a checkpoint's: transformers 5.x writes
        vision_tower.* (or model.vision_tower.*), 4.x vision_tower.vision_model.*; the patch conv's
        [out, C, p, p] becomes MLX's [out, p, p, C] (a checkpoint already in MLX's layout is kept)."""
        out = {}
        for name, value in weights.items():
            name = name.removeprefix("model.")
            if not name.startswith(_PREFIXES):
                continue
            name = name.replace("vision_tower.vision_model.", "vision_tower.", 1)
            if name.startswith(_UNUSED):
                continue
            if name.endswith("patch_embedding.weight") and value.shape[-1] == value.shape[-2]:  # [out, C, p, p]
                value = value.transpose(0, 2, 3, 1)
            out[name] = value
        return out
