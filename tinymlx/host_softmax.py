"""Attention's softmax on the CPU through numpy, for score tiles large enough to pay a host sync.

On 2.9M float32 values mlx 0.32.4's Linux CPU wheel took 31.8 ms for exp and 10.5 ms for power, numpy's
vectorised exp 1.8 ms (AVX-512, a 2-core EPYC). Over one prefill tile's scores (64 queries x 14 heads x
2,432 keys) the masked softmax took 3.6 ms in numpy against 14 ms in MLX (power of two, see fast_math).
On the CPU an evaluated MLX array is readable from numpy in place, so the scores cross with one copy;
the price is that the forward evaluates up to the scores before numpy reads them, which only pays for
large tiles. A GPU never comes here.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

# Alone, one layer's attention already ran faster through numpy at 28,672 scores (0.52 against 0.56 ms) and
# 114,688 (1.31 against 1.67); below this, small decode steps keep their one evaluation per step.
MIN_SCORES = 1 << 16


def is_worth_it(num_scores: int, dtype: mx.Dtype) -> bool:
    """float32 only: numpy has no bfloat16, and a half-precision model's scores stay in MLX."""
    return num_scores >= MIN_SCORES and dtype == mx.float32 and mx.default_device() == mx.cpu


def unnormalized_softmax(scores: mx.array, visible: mx.array) -> tuple[mx.array, mx.array]:
    """attention.unnormalized_softmax for natural-log scores: (e^(scores - row max) where `visible`, 0
    elsewhere; its sum over the last axis). `visible` broadcasts against `scores`."""
    mx.eval(scores, visible)
    weights = np.array(scores)  # a copy: numpy writes into it, never into MLX's buffer
    np.copyto(weights, np.float32(-np.inf), where=~np.asarray(visible))
    weights -= weights.max(axis=-1, keepdims=True)
    np.exp(weights, out=weights)
    return mx.array(weights), mx.array(weights.sum(axis=-1, keepdims=True))
