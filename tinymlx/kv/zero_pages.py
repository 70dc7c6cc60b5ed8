"""Zeroed arrays for the pools (kv_cache.py's pages, state_cache.py's slots), through NumPy's zero pages."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def zeros(shape: tuple[int, ...], dtype: mx.Dtype = mx.float32) -> mx.array:
    """mx.zeros through NumPy's zero pages: on the CPU, with the weights loaded, mx.zeros filled the
    default model's 1.5 GiB pool in 5.6 s, this in 1.0 s. All-zero bits are 0.0 in every float dtype.
    (Zeros, not garbage: a masked slot's V is multiplied by a zero weight, and garbage could be NaN.)"""
    return mx.array(np.zeros(shape, dtype=f"u{dtype.size}")).view(dtype)
