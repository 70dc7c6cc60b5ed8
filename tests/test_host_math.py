"""The CPU's numpy paths for a step's largest elementwise math against MLX's own ops."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from tinymlx.models.layers import gelu_tanh_mul, silu_mul
from tinymlx.ops.cpu import host_math


def test_large_float32_tensors_take_numpy_on_the_cpu_only():
    assert host_math.is_worth_it(host_math.MIN_VALUES, mx.float32)
    assert not host_math.is_worth_it(host_math.MIN_VALUES - 1, mx.float32)
    assert not host_math.is_worth_it(host_math.MIN_VALUES, mx.bfloat16)


@pytest.mark.parametrize(("activation", "reference"), [(silu_mul, nn.silu), (gelu_tanh_mul, nn.gelu_approx)])
@pytest.mark.parametrize("rows", [1, 85])  # below and above MIN_VALUES over 896 columns
@pytest.mark.kernel_paths("portable", "cpu")
def test_gated_activation_equals_mlx(activation, reference, rows, kernel_path):
    """Over gate values from -30 to 30 (exp's overflow side included): numpy's result where the tensor is
    large, MLX's below, both equal to MLX's own activation times up, and of the gate's shape and dtype."""
    rng = np.random.default_rng(rows)
    gate = mx.array(np.linspace(-30, 30, rows * 896, dtype=np.float32).reshape(rows, 896))
    up = mx.array(rng.normal(0, 1, (rows, 896)).astype(np.float32))
    assert host_math.is_worth_it(gate.size, gate.dtype) == (rows == 85)
    out = activation(gate, up)
    assert out.shape == gate.shape and out.dtype == mx.float32
    assert float(mx.abs(out - reference(gate) * up).max()) < 1e-5


@pytest.mark.parametrize("num_keys", [64, 4096])  # 16 rows of them: the power of two's tile, numpy's
def test_the_cpu_softmax_leaves_no_subnormal_weight(num_keys):
    """Scores 0 to -200 below each row's best: weights under float32's smallest normal are exactly 0 (BLAS
    multiplies subnormals many times slower), the others equal the exact softmax's, and masked keys weigh 0."""
    from tinymlx.ops.cpu import masked_softmax_for, power_softmax

    scores = mx.array(np.tile(np.linspace(0, -200, num_keys, dtype=np.float32), (16, 1)))
    visible = mx.array(np.arange(num_keys) % 7 != 3)[None]
    softmax, units = masked_softmax_for(scores.size, mx.float32)
    assert (softmax is power_softmax) == (num_keys == 64)
    weights, total = softmax(scores * units, visible)
    weights = np.array(weights)
    reference = np.where(np.array(visible), np.exp(np.array(scores, dtype=np.float64)), 0)  # each row's best is 0
    smallest = np.finfo(np.float32).tiny
    assert np.all((weights == 0) | (weights >= smallest)) and np.any((reference > 0) & (reference < smallest))
    kept = reference >= smallest * 2
    np.testing.assert_allclose(weights[kept], reference[kept], rtol=1e-4)
    assert np.all(weights[:, np.arange(num_keys) % 7 == 3] == 0)
    np.testing.assert_allclose(np.array(total)[:, 0], reference.sum(-1), rtol=1e-5)
