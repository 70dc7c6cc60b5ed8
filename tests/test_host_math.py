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
