"""Pieces the packed-patch vision towers share (Qwen2-VL's lineage): attention that stays inside segments of
one packed sequence (images, frames, windows), and 2D rotary embeddings over (row, column) patch ids.

A tower packs every image's patches into one sequence [N, dim]; cu_seqlens-style segment lengths say
where each attention block starts. `Segments` runs that block-diagonal attention as one batched sdpa per
distinct segment length, so no N x N mask is ever built and window layers cost N * window, not N^2.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from tinymlx.ops import kernels


@dataclass(frozen=True, eq=False)
class Segments:
    """Block-diagonal attention over consecutive segments of a packed sequence.

    `groups`: (number of segments, length) per distinct length, in the order `order` lays tokens out;
    `order` gathers the segments of each length together (None when they already are) and `inverse`
    puts the outputs back."""

    groups: tuple[tuple[int, int], ...]
    order: mx.array | None
    inverse: mx.array | None

    @classmethod
    def from_lengths(cls, lengths: Sequence[int]) -> Segments:
        """Segments of these lengths, one after another from token 0 (empty ones are skipped)."""
        starts_by_length: dict[int, list[int]] = {}
        for start, length in zip(np.cumsum([0, *lengths[:-1]]).tolist(), lengths):
            if length:
                starts_by_length.setdefault(length, []).append(start)
        groups = tuple((len(starts), length) for length, starts in starts_by_length.items())
        order = np.concatenate([(np.array(starts)[:, None] + np.arange(length)).reshape(-1)
                                for length, starts in starts_by_length.items()])
        if np.array_equal(order, np.arange(order.size)):
            return cls(groups, None, None)
        return cls(groups, mx.array(order, dtype=mx.int32), mx.array(np.argsort(order), dtype=mx.int32))

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """q, k, v [N, heads, head_dim] -> [N, heads, head_dim]: each token attends to its own segment."""
        if self.order is not None:
            q, k, v = q[self.order], k[self.order], v[self.order]
        outputs, start = [], 0
        for count, length in self.groups:
            end = start + count * length
            batch = [x[start:end].reshape(count, length, *x.shape[1:]).transpose(0, 2, 1, 3) for x in (q, k, v)]
            out = kernels.dense_attention(*batch, scale)
            outputs.append(out.transpose(0, 2, 1, 3).reshape(end - start, *v.shape[1:]))
            start = end
        out = mx.concatenate(outputs) if len(outputs) > 1 else outputs[0]
        return out if self.inverse is None else out[self.inverse]


def rope_2d(x: mx.array, positions: mx.array, theta: float) -> mx.array:
    """x [N, heads, head_dim] rotated by (row, column) `positions` [N, 2], as HF's vision rotary does:
    the head's first and third quarters rotate by the row, its second and fourth by the column.

    Each quarter pair is one plain (non-traditional) RoPE of head_dim / 2 dims, so the two run as a
    batch of 2N rows through mx.fast.rope. The result keeps that batch's layout, [N, heads, (axis, half,
    head_dim / 4)]: a permutation of the head's dims, so apply it to q and k alike (their dot products
    are unchanged) and never to v."""
    N, heads, head_dim = x.shape
    quarter = head_dim // 4
    by_axis = x.reshape(N, heads, 2, 2, quarter).transpose(0, 3, 1, 2, 4).reshape(2 * N, heads, 1, 2 * quarter)
    rotated = mx.fast.rope(by_axis, 2 * quarter, traditional=False, base=theta, scale=1.0,
                           offset=positions.reshape(-1))
    return rotated.reshape(N, 2, heads, 2 * quarter).transpose(0, 2, 1, 3).reshape(N, heads, head_dim)
