"""Math on the CPU through numpy: a step's largest elementwise math (attention's softmax, the gated MLP's
activation) for tensors large enough to pay a host sync, and one-row float32 matmuls (linear.py says why).

On 2.9M float32 values mlx 0.32.4's Linux CPU wheel took 31.8 ms for exp and 10.5 ms for power, numpy's
vectorised exp 1.8 ms (AVX-512, a 2-core EPYC). Over one prefill tile's scores (64 queries x 14 heads x
2,432 keys) the masked softmax took 3.6 ms in numpy against 14 ms in MLX (power of two, see fast_math.py);
SiLU(gate) * up over [85, 8960] (the 1.5B's MLP in an agent's turn) 0.66-0.87 ms against 5.6-5.9.
On the CPU an evaluated MLX array is readable from numpy in place, so each side crosses with one copy;
the price is that the forward evaluates up to the inputs before numpy reads them, which only pays for
large tensors. Only the CPU's kernels come here (cpu/__init__.py): a GPU never does.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from tinymlx.ops.cpu import rows_kernel

# Alone, one layer's attention already ran faster through numpy at 28,672 scores (0.52 against 0.56 ms) and
# 114,688 (1.31 against 1.67); below this, small decode steps keep their one evaluation per step.
MIN_VALUES = 1 << 16
GELU_TANH_SCALE = -2.0 * math.sqrt(2.0 / math.pi)  # 0.5 * (1 + tanh(z)) = sigmoid(2z): cpu/__init__.py
_SMALLEST_NORMAL = np.finfo(np.float32).tiny


def is_worth_it(num_values: int, dtype: mx.Dtype) -> bool:
    """float32 only: numpy has no bfloat16, and a half-precision model's math stays in MLX."""
    return num_values >= MIN_VALUES and dtype == mx.float32


def unnormalized_softmax(scores: mx.array, visible: mx.array) -> tuple[mx.array, mx.array]:
    """attention.unnormalized_softmax for natural-log scores: (e^(scores - row max) where `visible`, 0
    elsewhere; its sum over the last axis). `visible` broadcasts against `scores`."""
    mx.eval(scores, visible)
    weights = np.array(scores)  # a copy: numpy writes into it, never into MLX's buffer
    np.copyto(weights, np.float32(-np.inf), where=~np.asarray(visible))
    weights -= weights.max(axis=-1, keepdims=True)
    np.exp(weights, out=weights)
    flush_subnormals(weights)
    return mx.array(weights), mx.array(weights.sum(axis=-1, keepdims=True))


def sigmoid_gated_mul(gate: mx.array, z: mx.array, scale: float, up: mx.array) -> mx.array:
    """gate / (1 + e^(scale * z)) * up, all three of one shape: SiLU(gate) * up is z = gate and scale -1,
    the tanh GELU a cubic of gate (cpu/__init__.py)."""
    mx.eval(gate, z, up)  # MLX's buffers are only read: the result is numpy's own
    return mx.array(sigmoid_gated(np.asarray(gate), np.asarray(z), scale, np.asarray(up)))


def is_one_row(x: mx.array) -> bool:
    """A float32 input of one row: numpy's gemv streams the weight twice as fast as MLX's sgemm (linear.py)."""
    return x.size == x.shape[-1] and x.dtype == mx.float32


def is_few_rows(x: mx.array) -> bool:
    """2 to rows_kernel.MAX_ROWS float32 rows, where the kernels exist: one read of the weight for all of them."""
    return rows_kernel.available() and 2 <= x.size // x.shape[-1] <= rows_kernel.MAX_ROWS and x.dtype == mx.float32


def rows_times(x: mx.array, weight: mx.array, bias: mx.array | None) -> mx.array:
    """x @ W.T (+ bias) for a few rows x [..., in] (is_few_rows) and W [out, in], through rows_kernel."""
    mx.eval(x)
    y = rows_kernel.times(np.asarray(x).reshape(-1, x.shape[-1]), np.asarray(weight))
    if bias is not None:
        y += np.asarray(bias)
    return mx.array(y).reshape(*x.shape[:-1], -1)


def row_times(x: mx.array, weight: mx.array, input_major: bool, bias: mx.array | None) -> mx.array:
    """x @ W.T (+ bias) for one row x [..., in]: `weight` is W [out, in], or W.T [in, out] when `input_major`.
    The weight is read in place (an evaluated MLX array is a numpy view on the CPU)."""
    mx.eval(x)
    matrix = np.asarray(weight) if input_major else np.asarray(weight).T
    y = np.asarray(x).reshape(-1) @ matrix  # a vector times a matrix: BLAS's gemv
    if bias is not None:
        y += np.asarray(bias)
    return mx.array(y).reshape(*x.shape[:-1], -1)


def sigmoid_gated(gate: np.ndarray, z: np.ndarray, scale: float, up: np.ndarray) -> np.ndarray:
    """gate / (1 + e^(scale * z)) * up, a new array: SiLU(gate) * up is z = gate and scale -1, the tanh GELU
    z = gate + 0.044715 gate^3 and GELU_TANH_SCALE."""
    out = np.multiply(z, np.float32(scale))
    with np.errstate(over="ignore"):  # e^x = inf for a very negative gate: gate / inf is its 0 activation
        np.exp(out, out=out)
    out += np.float32(1.0)
    np.divide(gate, out, out=out)
    out *= up
    return out


def flush_subnormals(weights: np.ndarray) -> None:
    """Softmax weights below float32's smallest normal (a key e^-88 below the row's best) count for nothing,
    but the x86 BLAS multiplying them by V takes microcode assists: 8x slower at 512-wide heads over 4k keys
    (measured). Set to 0 in place."""
    np.copyto(weights, np.float32(0), where=weights < _SMALLEST_NORMAL)
