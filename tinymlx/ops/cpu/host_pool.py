"""The paged pool's K and V arrays as numpy views, through which the runner's one-row step reads them in
place: MLX's arrays and numpy share the CPU's memory. It writes nothing: the row's new K/V go through the
pool's one write call (kv_cache.PagedKVCache.write), as the graph's do."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class HostPool:
    """Each place's (K, V) arrays [kv_heads, slots, head_dim] (full precision only) as numpy views. Take one
    per step and drop it before the step's writes: a view still held would keep MLX's scatter from reusing
    an array's buffer (it would copy the whole array)."""

    def __init__(self, places: list[tuple[mx.array, ...]]):
        self.places = [tuple(np.asarray(array) for array in arrays) for arrays in places]

    def read_with(self, place: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K and V [kv_heads, len(slots) + 1, head_dim]: copies of those at `slots`, then the new token's
        `k` and `v` [kv_heads, head_dim], which the pool does not hold yet."""
        both = []
        for array, new in zip(self.places[place], (k, v)):
            out = np.empty((array.shape[0], len(slots) + 1, array.shape[2]), dtype=array.dtype)
            np.take(array, slots, axis=1, out=out[:, :-1], mode="clip")  # "clip": no buffered copy of `out`
            out[:, -1] = new
            both.append(out)
        return both[0], both[1]
