"""Gemma 4's vision encoder and its embedder into the text model (transformers' Gemma4VisionModel and
Gemma4Model.embed_vision), for images of any aspect ratio as patch sequences.

    patches [B, P, 3 p p] in [0, 1]  --2 x - 1, linear, + x and y position embeddings-->  [B, P, D]
      --Gemma-style blocks: sandwich RMSNorms, q/k/v norms, 2-D RoPE, scale 1, bidirectional over the
        image's own patches, gated GELU-tanh MLP-->  [B, P, D]
      --average over k x k squares of the patch grid, x sqrt(D), standardize-->  num_soft_tokens rows
      --scale-free RMSNorm, projection-->  [tokens, text hidden]

The rows replace the image placeholder tokens' rows after the text embedding's sqrt(hidden) scale (they are
not scaled). Per-layer inputs at those positions read the pad token's id and the replaced rows; with
use_bidirectional_attention "vision", the sliding layers let each image's tokens see each other both ways.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tinymlx.models.layers import RMSNorm, activation
from tinymlx.models.rope import RoPE

_PREFIXES = ("vision_tower.", "embed_vision.")
# Gemma4VisionConfig's defaults, for a config.json that leaves them out
_DEFAULTS = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=12,
                 num_key_value_heads=12, head_dim=64, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "axial", "rope_theta": 100.0}, pooling_kernel_size=3, patch_size=16,
                 position_embedding_size=10_240, use_clipped_linears=False, standardize=False)


class ClippableLinear(nn.Module):
    """A bias-free linear; with `use_clipped_linears` its input and output are clamped to ranges the
    checkpoint stores (scalars named as transformers names them)."""

    def __init__(self, in_dims: int, out_dims: int, clipped: bool):
        super().__init__()
        self.linear = nn.Linear(in_dims, out_dims, bias=False)
        if clipped:
            self.input_min, self.input_max = mx.array(-mx.inf), mx.array(mx.inf)
            self.output_min, self.output_max = mx.array(-mx.inf), mx.array(mx.inf)

    def __call__(self, x: mx.array) -> mx.array:
        if "input_min" not in self:
            return self.linear(x)
        x = self.linear(mx.clip(x, self.input_min, self.input_max))
        return mx.clip(x, self.output_min, self.output_max)


class VisionAttention(nn.Module):
    """Attention over an image's patches: q and k RMSNormed per head then rotated by the patch's column
    (first half of each head) and row (second half), v normed without a scale, scores scaled by 1."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        dims, clipped, eps = config["hidden_size"], config["use_clipped_linears"], config["rms_norm_eps"]
        self.num_heads, self.num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.head_dim = config["head_dim"]
        self.q_proj = ClippableLinear(dims, self.num_heads * self.head_dim, clipped)
        self.k_proj = ClippableLinear(dims, self.num_kv_heads * self.head_dim, clipped)
        self.v_proj = ClippableLinear(dims, self.num_kv_heads * self.head_dim, clipped)
        self.o_proj = ClippableLinear(self.num_heads * self.head_dim, dims, clipped)
        self.q_norm, self.k_norm = RMSNorm(self.head_dim, eps), RMSNorm(self.head_dim, eps)
        self.eps = eps
        rope = config["rope_parameters"]
        if rope.get("rope_type", "axial") not in ("axial", "default"):  # transformers reads "default" as axial
            raise ValueError(f"vision rope_type {rope['rope_type']!r} is not supported (only 'axial')")
        self.rope = RoPE(self.head_dim // 2, rope.get("rope_theta", 100.0))

    def _rotate(self, x: mx.array, positions: mx.array) -> mx.array:
        """x [B, P, heads, head_dim]; each half turned by one axis of `positions` [B, P, 2] (x, y)."""
        B, P, H, D = x.shape
        flat, columns, rows = x.reshape(B * P, H, D), positions[..., 0].reshape(-1), positions[..., 1].reshape(-1)
        rotated = [self.rope(flat[..., :D // 2], columns), self.rope(flat[..., D // 2:], rows)]
        return mx.concatenate(rotated, axis=-1).reshape(B, P, H, D)

    def __call__(self, x: mx.array, positions: mx.array, visible: mx.array | None) -> mx.array:
        B, P, _ = x.shape
        q = self._rotate(self.q_norm(self.q_proj(x).reshape(B, P, self.num_heads, -1)), positions)
        k = self._rotate(self.k_norm(self.k_proj(x).reshape(B, P, self.num_kv_heads, -1)), positions)
        v = mx.fast.rms_norm(self.v_proj(x).reshape(B, P, self.num_kv_heads, -1), None, self.eps)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=visible)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, P, -1))


class VisionMLP(nn.Module):
    def __init__(self, config: dict[str, Any]):
        super().__init__()
        dims, hidden, clipped = config["hidden_size"], config["intermediate_size"], config["use_clipped_linears"]
        self.gate_proj = ClippableLinear(dims, hidden, clipped)
        self.up_proj = ClippableLinear(dims, hidden, clipped)
        self.down_proj = ClippableLinear(hidden, dims, clipped)
        self.act = activation(config["hidden_activation"])

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))


class VisionEncoderLayer(nn.Module):
    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.self_attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

        def norm() -> RMSNorm:
            return RMSNorm(config["hidden_size"], config["rms_norm_eps"])

        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()

    def __call__(self, x: mx.array, positions: mx.array, visible: mx.array | None) -> mx.array:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, visible))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class VisionEncoder(nn.Module):
    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.layers = [VisionEncoderLayer(config) for _ in range(config["num_hidden_layers"])]

    def __call__(self, x: mx.array, positions: mx.array, visible: mx.array | None) -> mx.array:
        for layer in self.layers:
            x = layer(x, positions, visible)
        return x


class PatchEmbedder(nn.Module):
    """A patch's pixels (mapped from [0, 1] to [-1, 1] here: the processor does not normalize) projected, plus
    a learned embedding of its column and one of its row; padding patches get no position."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        dims = config["hidden_size"]
        self.input_proj = nn.Linear(3 * config["patch_size"] ** 2, dims, bias=False)
        self.position_embedding_table = mx.zeros((2, config["position_embedding_size"], dims))

    def __call__(self, pixel_values: mx.array, positions: mx.array, is_padding: mx.array) -> mx.array:
        h = self.input_proj((2 * (pixel_values - 0.5)).astype(self.input_proj.weight.dtype))
        where = mx.maximum(positions, 0)
        embedded = self.position_embedding_table[0][where[..., 0]] + self.position_embedding_table[1][where[..., 1]]
        return h + mx.where(is_padding[..., None], 0, embedded).astype(h.dtype)


class VisionModel(nn.Module):
    """transformers' Gemma4VisionModel up to its pooled, standardized features [B, P / k^2, D] (padding
    rows still in: VisionTower picks the real ones)."""

    def __init__(self, config: dict[str, Any]):
        super().__init__()
        self.patch_embedder = PatchEmbedder(config)
        self.encoder = VisionEncoder(config)
        if config["standardize"]:
            self.std_bias, self.std_scale = mx.zeros((config["hidden_size"],)), mx.ones((config["hidden_size"],))

    def __call__(self, pixel_values: mx.array, positions: mx.array, cells: mx.array, length: int,
                 has_padding: bool) -> mx.array:
        is_padding = (positions == -1).all(axis=-1)
        visible = ~is_padding[:, None, None, :] if has_padding else None  # keys: the image's own patches
        h = self.encoder(self.patch_embedder(pixel_values, positions, is_padding), positions, visible)
        h = mx.where(is_padding[..., None], 0, h).astype(mx.float32)
        if length != h.shape[1]:  # each k x k square of patches averaged into its pooled cell
            k_squared = h.shape[1] // length
            h = ((cells[..., None] == mx.arange(length)).astype(mx.float32) / k_squared).swapaxes(1, 2) @ h
        h = h * h.shape[-1] ** 0.5  # in float32: the scale can pass float16's range
        if "std_bias" in self:
            h = (h - self.std_bias.astype(mx.float32)) * self.std_scale.astype(mx.float32)
        return h.astype(self.patch_embedder.input_proj.weight.dtype)


class MultimodalEmbedder(nn.Module):
    """Soft tokens into the text model's space: a scale-free RMSNorm, then a projection."""

    def __init__(self, dims: int, text_hidden_size: int, eps: float):
        super().__init__()
        self.embedding_projection = nn.Linear(dims, text_hidden_size, bias=False)
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return self.embedding_projection(mx.fast.rms_norm(x, None, self.eps))


class VisionTower(nn.Module):
    """Gemma 4's vision encoder + embed_vision. Its input is what transformers' Gemma4ImageProcessor makes:

    `pixel_values` [B, P, 3 * p * p]: each image resized (aspect ratio kept, sides multiples of k * p),
    rescaled to [0, 1] and not normalized; cut into p x p patches in row-major order over the patch grid,
    each flattened as (row in patch, column in patch, channel); padded with zero patches up to P
    (max_soft_tokens * k^2), or given alone unpadded. `position_ids` [B, P, 2] integers: each patch's
    (column, row) in the patch grid, (-1, -1) for padding (np.ndarray or mx.array; read on the host).

    Returns [sum of num_soft_tokens, text hidden]: image b gives its real patches / k^2 rows (the
    processor's num_soft_tokens_per_image), in row-major order of its pooled grid, images in order."""

    def __init__(self, vision: dict[str, Any], text_hidden_size: int):
        super().__init__()
        self.pooling_kernel_size = vision["pooling_kernel_size"]
        self.vision_tower = VisionModel(vision)
        self.embed_vision = MultimodalEmbedder(vision.get("output_proj_dims", vision["hidden_size"]),
                                               text_hidden_size, vision["rms_norm_eps"])

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> VisionTower:
        """From a gemma4 checkpoint's whole config.json."""
        if config.get("vision_config") is None:
            raise ValueError("this gemma4 config has no vision_config: the checkpoint has no vision encoder")
        return cls({**_DEFAULTS, **config["vision_config"]}, config["text_config"]["hidden_size"])

    def __call__(self, pixel_values: mx.array | np.ndarray, position_ids: mx.array | np.ndarray) -> mx.array:
        positions = np.asarray(position_ids).astype(np.int32)
        cells, length, kept = _pooled_cells(positions, self.pooling_kernel_size)
        is_padding = (positions == -1).all(axis=-1)
        pooled = self.vision_tower(mx.array(pixel_values), mx.array(positions), mx.array(cells), length,
                                   bool(is_padding.any()))
        return self.embed_vision(pooled.reshape(-1, pooled.shape[-1])[mx.array(kept)])

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The encoder's and embed_vision's tensors from all of a checkpoint's (model.* in transformers 5.x,
        or without the prefix)."""
        return {name.removeprefix("model."): value for name, value in weights.items()
                if name.removeprefix("model.").startswith(_PREFIXES)}


def _pooled_cells(positions: np.ndarray, k: int) -> tuple[np.ndarray, int, np.ndarray]:
    """Where each patch is averaged to (as transformers' pooler computes it: column // k + row // k times the
    pooled grid's width), the pooled length per image, and the flat rows of [B * length] that real patches
    fill, in order (the processor's grid fills cells 0 .. n - 1)."""
    B, P, _ = positions.shape
    length = P // (k * k)
    if length * k * k != P:
        raise ValueError(f"{P} patches per image do not pool by {k} x {k}: pad them to a multiple of {k * k}")
    if k == 1:  # nothing pooled: the real patches as they come
        return np.zeros((B, P), np.int32), P, np.flatnonzero((positions != -1).any(axis=-1)).astype(np.int32)
    clamped = np.maximum(positions, 0)
    width = clamped[..., 0].max(axis=-1, keepdims=True) + 1
    cells = clamped[..., 0] // k + (width // k) * (clamped[..., 1] // k)
    if cells.max(initial=0) >= length:
        raise ValueError("patch positions fall outside the pooled grid: not a grid of the processor's")
    filled = [np.unique(cells[b]) + b * length for b in range(B)]
    return cells.astype(np.int32), length, np.concatenate(filled).astype(np.int32)
