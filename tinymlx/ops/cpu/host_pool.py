"""The paged pool's K and V arrays as numpy views, through which the runner's one-row step writes and reads
them in place: MLX's arrays and numpy share the CPU's memory."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class HostPool:
    """Each place's (K, V) arrays [kv_heads, slots, head_dim] (full precision only) as numpy views. Take one
    per step and drop it after: a view held across steps would keep MLX's next scatter from reusing an
    array's buffer."""

    def __init__(self, places: list[tuple[mx.array, ...]]):
        self.places = [tuple(np.asarray(array) for array in arrays) for arrays in places]

    def write(self, place: int, slot: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store one token's K/V [kv_heads, head_dim] in `slot`."""
        keys, values = self.places[place]
        keys[:, slot], values[:, slot] = k, v

    def read(self, place: int, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K and V [kv_heads, len(slots), head_dim] at `slots`, copies."""
        keys, values = self.places[place]
        return keys[:, slots], values[:, slots]
