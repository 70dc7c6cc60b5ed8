"""Attention math shared by the paged backend and the dense reference (tests/dense_attention.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx

from tinymlx.ops import fast_math, host_math


def unnormalized_softmax(scores: mx.array, visible: mx.array) -> tuple[mx.array, mx.array]:
    """Softmax over the last axis of `scores` given in log2 units (natural-log scores times log2 e), where
    `visible` (exactly 0 elsewhere), before its division: (weights, their sum over the last axis).

    The caller divides after multiplying by V: [queries, head_dim] divides, not [queries, keys], a pass
    over millions of scores per layer saved in prefill. Powers of two, not mx.softmax: its exp is the slow
    one (see fast_math), and the log2 e is folded into the scale the queries are multiplied by anyway.
    """
    scores = mx.where(visible, scores, mx.array(-mx.inf, dtype=scores.dtype))
    weights = fast_math.exp2(scores - scores.max(axis=-1, keepdims=True))
    return weights, weights.sum(axis=-1, keepdims=True)


def masked_softmax_for(num_scores: int, dtype: mx.Dtype) -> tuple[Callable, float]:
    """The masked softmax a tile of `num_scores` scores takes (numpy's for large float32 tiles on the CPU,
    else MLX's power of two), and the factor its scores must carry: numpy's exp takes natural-log scores,
    the power of two log2 ones, and the queries' scale multiply folds it in."""
    if host_math.is_worth_it(num_scores, dtype):
        return host_math.unnormalized_softmax, 1.0
    return unnormalized_softmax, fast_math.LOG2E


class QuantizedKV(NamedTuple):
    """K or V in MLX's affine 8-bit form (an int8 pool's gather): codes packed four per uint32 [..., T, D/4],
    scales and biases [..., T, D/group_size]."""

    codes: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int


KV = mx.array | QuantizedKV


def grouped_query_attention(q: mx.array, k: KV, v: KV, visible: mx.array, scale: float) -> mx.array:
    """Masked attention with query heads grouped under their KV head.

    q [B, L, H, D]; k, v [KV, B, T, D] (KV heads first: the paged pool's gather layout), or their int8
    form; visible [B, L, T] (True where a query may see a key). Returns [B, L, H, D]. Grouping the
    queries as [KV, B, group*L, D] turns GQA into two plain batched matmuls over contiguous K/V,
    which on the CPU beat SDPA over gathered K/V.
    """
    B, L, H, D = q.shape
    num_kv = k.shape[0] if isinstance(k, mx.array) else k.codes.shape[0]
    group = H // num_kv
    q = q.reshape(B, L, num_kv, group, D).transpose(2, 0, 3, 1, 4).reshape(num_kv, B, group * L, D)
    softmax, units = masked_softmax_for(H * B * L * visible.shape[-1], q.dtype)
    scores = _matmul(q * (scale * units), k, transpose=True)
    weights, total = softmax(scores.reshape(num_kv, B, group, L, -1), visible[None, :, None])
    out = _matmul(weights.reshape(num_kv, B, group * L, -1), v, transpose=False) / total.reshape(num_kv, B, group * L, 1)
    return out.reshape(num_kv, B, group, L, D).transpose(1, 3, 0, 2, 4).reshape(B, L, H, D)


def _matmul(x: mx.array, kv: KV, transpose: bool) -> mx.array:
    """x @ kv.T (transpose) or x @ kv. Int8 K/V: decodes multiply the codes (quantized_matmul reads a
    quarter of the bytes); prefill tiles on the CPU dequantize their tile's context first, because the
    CPU's quantized_matmul has no BLAS path and many queries make the product compute-bound (3x slower
    at 384 queries x 2k keys, measured)."""
    if isinstance(kv, mx.array):
        return x @ (kv.swapaxes(-1, -2) if transpose else kv)
    if x.shape[-2] > _QUANTIZED_MATMUL_MAX_ROWS and mx.default_device() == mx.cpu:
        dense = mx.dequantize(kv.codes, kv.scales, kv.biases, group_size=kv.group_size, bits=8)
        return x @ (dense.swapaxes(-1, -2) if transpose else dense)
    return mx.quantized_matmul(x, kv.codes, kv.scales, kv.biases, transpose=transpose,
                               group_size=kv.group_size, bits=8)


_QUANTIZED_MATMUL_MAX_ROWS = 64  # query rows per KV head (group * L) up to which the CPU multiplies codes



def first_visible_key(position: int, window: int | None) -> int:
    """The first key a query at `position` sees: 0, or with a window W position - W + 1 (see visible_keys)."""
    return 0 if window is None else max(0, position - window + 1)


def visible_keys(query_positions: mx.array, key_positions: mx.array, window: int | None) -> mx.array:
    """[..., queries, keys]: True where a query may see a key. Causal; with a window W, a query at
    position p sees only keys at p-W+1..p (transformers' sliding_window convention)."""
    q, k = query_positions[..., :, None], key_positions[..., None, :]
    visible = k <= q
    return visible if window is None else visible & (k > q - window)
