"""One decode row's math in numpy: RMSNorm, rotary embeddings, gated activations and attention over one
query, for the CPU's one-row step (runner/cpu_row_step.py says why a single stream runs there).

Each function mirrors the MLX op model code calls, in float32 (mx.fast.rms_norm, mx.fast.rope's
non-traditional form, kernels.silu_mul / gelu_tanh_mul, attention.grouped_query_attention), on arrays
of one row: a numpy call on a vector costs ~1-2 us where an MLX op on the CPU costs ~8 us to dispatch
and a host evaluation before each numpy gemv.
"""

from __future__ import annotations

import math

import numpy as np

_SMALLEST_NORMAL = np.finfo(np.float32).tiny
GELU_TANH_SCALE = -2.0 * math.sqrt(2.0 / math.pi)  # 0.5 * (1 + tanh(z)) = sigmoid(2z): cpu/__init__.py


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """mx.fast.rms_norm over the last axis."""
    mean_square = np.einsum("...i,...i->...", x, x)[..., None] / np.float32(x.shape[-1])
    return x / np.sqrt(mean_square + np.float32(eps)) * weight


def rotation(position: int, periods: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) [dims/2] of a token at `position` for rotary pairs of the given `periods` (the position
    over which each pair turns one radian: mx.fast.rope's base ** (2i / dims) / scale, or its freqs / scale)."""
    angles = np.float64(position) / periods
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """mx.fast.rope, non-traditional, of x [heads, head_dim]: the first 2 * len(cos) features turn in
    halves (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos); any past them keep still."""
    half = cos.shape[0]
    x1, x2 = x[:, :half], x[:, half:2 * half]
    out = x.copy()
    out[:, :half] = x1 * cos - x2 * sin
    out[:, half:2 * half] = x1 * sin + x2 * cos
    return out


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


def silu_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return sigmoid_gated(gate, gate, -1.0, up)


def gelu_tanh_mul(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return sigmoid_gated(gate, gate + np.float32(0.044715) * gate * gate * gate, GELU_TANH_SCALE, up)


def flush_subnormals(weights: np.ndarray) -> None:
    """Softmax weights below float32's smallest normal (a key e^-88 below the row's best) count for nothing,
    but the x86 BLAS multiplying them by V takes microcode assists: 8x slower at 512-wide heads over 4k keys
    (measured). Set to 0 in place."""
    np.copyto(weights, np.float32(0), where=weights < _SMALLEST_NORMAL)


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float) -> np.ndarray:
    """One query's attention over the keys it sees: q [heads, D], keys and values [kv_heads, T, D] (query
    heads grouped under their KV head, as grouped_query_attention does). Returns [heads * D]."""
    num_kv, _, head_dim = keys.shape
    grouped = q.reshape(num_kv, -1, head_dim) * np.float32(scale)
    weights = np.matmul(grouped, keys.transpose(0, 2, 1))  # [kv_heads, group, T]
    weights -= weights.max(axis=-1, keepdims=True)
    np.exp(weights, out=weights)
    flush_subnormals(weights)
    out = np.matmul(weights, values) / weights.sum(axis=-1, keepdims=True)
    return out.reshape(-1)
