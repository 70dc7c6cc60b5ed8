"""DenseAttention: the reference attention backend the paged path is tested against."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from tinymlx.models import gated_delta
from tinymlx.ops.attention import visible_keys


class DenseAttention:
    """Reference backend: B equal-length sequences attend causally over their own fresh K/V.

    No cache, no block tables: the ground truth the paged path is tested against. `windows` gives
    each layer's sliding window (None: full attention), as the model's layer_specs() say.
    """

    def __init__(self, batch_size: int, seq_len: int, windows: Sequence[int | None] = (),
                 sources: dict[int, int] | None = None):
        """`sources`: shared-KV layers -> the layer whose K/V they attend over (given k = v = None)."""
        self.batch_size, self.seq_len, self.windows = batch_size, seq_len, tuple(windows)
        self.sources, self.kv = sources or {}, {}

    def __call__(self, layer: int, q: mx.array, k: mx.array | None, v: mx.array | None, scale: float,
                 sinks: mx.array | None = None) -> mx.array:
        B, L = self.batch_size, self.seq_len
        if k is None:
            k, v = self.kv[self.sources[layer]]
        self.kv[layer] = (k, v)
        q, k, v = (t.reshape(B, L, *t.shape[1:]).transpose(0, 2, 1, 3) for t in (q, k, v))
        window = self.windows[layer] if layer < len(self.windows) else None
        mask = "causal" if window is None else visible_keys(mx.arange(L), mx.arange(L), window)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)
        return out.transpose(0, 2, 1, 3).reshape(B * L, out.shape[1], out.shape[3])

    # Recurrent layers: each sequence from the zero state, the delta rule token by token.
    def conv1d(self, layer: int, x: mx.array, weight: mx.array) -> mx.array:
        B, L = self.batch_size, self.seq_len
        out, _ = gated_delta.causal_conv(x.reshape(B, L, -1), mx.zeros((B, weight.shape[-1] - 1, x.shape[-1])), weight)
        return out.reshape(B * L, -1)

    def delta_rule(self, layer: int, q: mx.array, k: mx.array, v: mx.array, g: mx.array,
                   beta: mx.array) -> mx.array:
        B, L = self.batch_size, self.seq_len
        H, Dk, Dv = q.shape[1], q.shape[2], v.shape[2]
        q, k, v, g, beta = (t.reshape(B, L, *t.shape[1:]) for t in (q, k, v, g, beta))
        out, _, _ = gated_delta.recurrent(q, k, v, g, beta, mx.zeros((B, H, Dk, Dv)))
        return out.reshape(B * L, H, Dv)
