"""Attention math shared by the paged backend and the dense reference."""

from __future__ import annotations

import mlx.core as mx


def grouped_query_attention(q: mx.array, k: mx.array, v: mx.array, visible: mx.array, scale: float) -> mx.array:
    """Masked attention with query heads grouped under their KV head.

    q [B, L, H, D]; k, v [B, KV, T, D]; visible [B, L, T] (True where a query may see a key).
    Returns [B, L, H, D]. Reshaping queries to [B, KV, group*L, D] turns GQA into two plain
    batched matmuls, which on the CPU beat SDPA over gathered (non-contiguous) K/V.
    """
    B, L, H, D = q.shape
    num_kv = k.shape[1]
    group = H // num_kv
    q = q.reshape(B, L, num_kv, group, D).transpose(0, 2, 3, 1, 4).reshape(B, num_kv, group * L, D)
    scores = (q * scale) @ k.swapaxes(-1, -2)
    scores = scores.reshape(B, num_kv, group, L, -1)
    scores = mx.where(visible[:, None, None], scores, mx.array(-mx.inf, dtype=scores.dtype))
    probs = mx.softmax(scores, axis=-1, precise=True).reshape(B, num_kv, group * L, -1)
    out = probs @ v
    return out.reshape(B, num_kv, group, L, D).transpose(0, 3, 1, 2, 4).reshape(B, L, H, D)


class DenseAttention:
    """Reference backend: B equal-length sequences attend causally over their own fresh K/V.

    No cache, no block tables: the ground truth the paged path is tested against.
    """

    def __init__(self, batch_size: int, seq_len: int, scale: float):
        self.batch_size, self.seq_len, self.scale = batch_size, seq_len, scale

    def __call__(self, layer: int, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        B, L = self.batch_size, self.seq_len
        q, k, v = (t.reshape(B, L, *t.shape[1:]).transpose(0, 2, 1, 3) for t in (q, k, v))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask="causal")
        return out.transpose(0, 2, 1, 3).reshape(B * L, out.shape[1], out.shape[3])
