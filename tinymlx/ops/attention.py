"""Attention over each sequence's gathered K/V: the portable path (what a Mac runs), and the grouped
form that int8 K/V and the CPU's kernels (cpu/) share. tests/dense_attention.py is the reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx


class QuantizedKV(NamedTuple):
    """K or V in MLX's affine 8-bit form (an int8 pool's gather): codes packed four per uint32 [..., T, D/4],
    scales and biases [..., T, D/group_size]."""

    codes: mx.array
    scales: mx.array
    biases: mx.array
    group_size: int


KV = mx.array | QuantizedKV
Softmax = Callable[[mx.array, mx.array], tuple[mx.array, mx.array]]
Matmul = Callable[[mx.array, KV, bool], mx.array]


def scaled_dot_product_attention(q: mx.array, k: KV, v: KV, visible: mx.array, scale: float,
                                 sinks: mx.array | None = None) -> mx.array:
    """The portable attention. q [B, L, H, D]; k, v [KV, B, T, D] (KV heads first: the paged pool's gather
    layout), or their int8 form; visible [B, L, T] (True where a query may see a key); sinks [H]: a learned
    logit per head that joins every softmax and takes its share of the mass without a value (gpt-oss).
    Returns [B, L, H, D].

    Float K/V go to mx.fast.scaled_dot_product_attention (GQA without tiling K/V, a boolean mask, its sinks);
    int8 K/V to the grouped form, whose matmuls read the codes as they are (quantized_matmul)."""
    if not isinstance(k, mx.array):
        return grouped_query_attention(q, k, v, visible, scale, sinks=sinks)
    out = mx.fast.scaled_dot_product_attention(q.transpose(0, 2, 1, 3), k.transpose(1, 0, 2, 3),
                                               v.transpose(1, 0, 2, 3), scale=scale, mask=visible[:, None],
                                               sinks=None if sinks is None else sinks.astype(q.dtype))
    return out.transpose(0, 2, 1, 3)


def unnormalized_softmax(scores: mx.array, visible: mx.array, exp: Callable[[mx.array], mx.array] = mx.exp
                         ) -> tuple[mx.array, mx.array]:
    """Softmax over the last axis of `scores` where `visible` (exactly 0 elsewhere), before its division:
    (weights, their sum over the last axis). `exp` matches the scores' units: mx.exp for natural-log
    scores, the CPU's power of two for log2 ones (cpu/fast_math.py).

    The caller divides after multiplying by V: [queries, head_dim] divides, not [queries, keys], a pass
    over millions of scores per layer saved in prefill."""
    scores = mx.where(visible, scores, mx.array(-mx.inf, dtype=scores.dtype))
    weights = exp(scores - scores.max(axis=-1, keepdims=True))
    return weights, weights.sum(axis=-1, keepdims=True)


def matmul(x: mx.array, kv: KV, transpose: bool) -> mx.array:
    """x @ kv.T (transpose) or x @ kv; int8 K/V multiply their codes (quantized_matmul reads a quarter of
    the bytes)."""
    if isinstance(kv, mx.array):
        return x @ (kv.swapaxes(-1, -2) if transpose else kv)
    return mx.quantized_matmul(x, kv.codes, kv.scales, kv.biases, transpose=transpose,
                               group_size=kv.group_size, bits=8)


def grouped_query_attention(q: mx.array, k: KV, v: KV, visible: mx.array, scale: float,
                            softmax: Softmax = unnormalized_softmax, units: float = 1.0,
                            matmul: Matmul = matmul, sinks: mx.array | None = None) -> mx.array:
    """Masked attention with query heads grouped under their KV head (shapes as scaled_dot_product_attention).

    Grouping the queries as [KV, B, group*L, D] turns GQA into two plain batched matmuls over contiguous
    K/V. `softmax` takes scores in `units` per natural-log unit (1; log2 e for a power of two), which the
    queries' scale multiply folds in, and `matmul` multiplies by K/V (plain or int8). A head's sink joins
    its softmax as one more, always visible, score whose weight is dropped: it counts in the total only.
    """
    B, L, H, D = q.shape
    num_kv = k.shape[0] if isinstance(k, mx.array) else k.codes.shape[0]
    group = H // num_kv
    q = q.reshape(B, L, num_kv, group, D).transpose(2, 0, 3, 1, 4).reshape(num_kv, B, group * L, D)
    scores = matmul(q * (scale * units), k, True).reshape(num_kv, B, group, L, -1)
    mask = visible[None, :, None]
    if sinks is not None:
        sink = (sinks.astype(scores.dtype) * units).reshape(num_kv, 1, group, 1, 1)
        scores = mx.concatenate([scores, mx.broadcast_to(sink, (*scores.shape[:-1], 1))], axis=-1)
        mask = mx.concatenate([mask, mx.ones((1, B, 1, L, 1), dtype=mx.bool_)], axis=-1)
    weights, total = softmax(scores, mask)
    if sinks is not None:
        weights = weights[..., :-1]
    out = matmul(weights.reshape(num_kv, B, group * L, -1), v, False) / total.reshape(num_kv, B, group * L, 1)
    return out.reshape(num_kv, B, group, L, D).transpose(1, 3, 0, 2, 4).reshape(B, L, H, D)


def first_visible_key(position: int, window: int | None) -> int:
    """The first key a query at `position` sees: 0, or with a window W position - W + 1 (see visible_keys)."""
    return 0 if window is None else max(0, position - window + 1)


def visible_keys(query_positions: mx.array, key_positions: mx.array, window: int | None,
                 spans: mx.array | None = None) -> mx.array:
    """[..., queries, keys]: True where a query may see a key. Causal; with a window W, a query at
    position p sees only keys at p-W+1..p (transformers' sliding_window convention). `spans` [..., queries, 2]:
    the (start, end) of the image a query lies in, whose keys it sees both ways (Gemma); (-1, -1) outside."""
    q, k = query_positions[..., :, None], key_positions[..., None, :]
    visible = k <= q
    if spans is not None:
        visible = visible | ((k >= spans[..., :1]) & (k < spans[..., 1:]))
    return visible if window is None else visible & (k > q - window)
