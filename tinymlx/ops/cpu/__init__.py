"""The CPU's kernels: the portable ones' values (portable.py), faster on MLX's CPU backend.

kernels.choose() takes them once at load when the device is the CPU, unless TINYMLX_PORTABLE=1; a GPU
never does. Why, measured with mlx 0.32.4's Linux CPU wheel on a 2-core EPYC (AVX-512):
- exp as a power of two (fast_math.py): on 2.9M float32 values exp took 31.8 ms, power 10.5 ms;
  sigmoid and SiLU through it ran 2.5-3x mx.sigmoid's and nn.silu's speed.
- Large float32 tensors through numpy (host_math.py), which paid 1.8 ms for the same exp: one prefill
  tile's masked softmax (64 queries x 14 heads x 2,432 keys) 3.6 ms against 14 ms in MLX, SiLU(gate) * up
  over [85, 8960] 0.66-0.87 ms against 5.6-5.9. The price is a host evaluation inside the forward, which
  pays only for large tensors (host_math.MIN_VALUES).
- Attention as two grouped matmuls over contiguous K/V (attention.grouped_query_attention), not SDPA, which
  has no fused CPU kernel: 46 against 104 ms for 8 tiles of 64 queries over 512 keys, 0.22 against 0.58 ms
  for a decode (the 0.5B's heads, 2-core Xeon). int8 prefill tiles dequantize their context first (below).
End to end on a 2-core Xeon, the default 0.5B in float32: prefill of 512 tokens 216.9 tok/s against the
portable kernels' 132.0, decode level (4.91 against 4.95) (docs/perf-notes.md).
"""

from __future__ import annotations

import mlx.core as mx

from tinymlx.ops import attention as portable_attention
from tinymlx.ops.attention import KV, Softmax, grouped_query_attention, unnormalized_softmax
from tinymlx.ops.cpu import fast_math, host_math, linear
from tinymlx.ops.cpu.blas_threads import BlasThreads
from tinymlx.ops.portable import Kernels


def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up through the power of two, or numpy for a large float32 one."""
    if gate.shape == up.shape and host_math.is_worth_it(gate.size, gate.dtype):
        return host_math.sigmoid_gated_mul(gate, gate, -1.0, up)
    return gate / (1.0 + fast_math.exp(gate, scale=-1.0)) * up


def gelu_tanh_mul(gate: mx.array, up: mx.array) -> mx.array:
    """gelu_pytorch_tanh(gate) * up. 0.5 * (1 + tanh(z)) is sigmoid(2z): one fast exp, as in silu_mul."""
    z = gate + 0.044715 * gate * gate * gate
    if gate.shape == up.shape and host_math.is_worth_it(gate.size, gate.dtype):
        return host_math.sigmoid_gated_mul(gate, z, host_math.GELU_TANH_SCALE, up)
    return gate / (1.0 + fast_math.exp(z, scale=host_math.GELU_TANH_SCALE)) * up


def power_softmax(scores: mx.array, visible: mx.array) -> tuple[mx.array, mx.array]:
    """attention.unnormalized_softmax for log2 scores (natural-log scores times log2 e): a power of two.
    Subnormal weights are flushed to 0, as host_math's are: BLAS multiplies them by V 2.7x slower (a
    512-wide head's decode over 4k keys, measured), and they count for nothing."""
    weights, total = unnormalized_softmax(scores, visible, fast_math.exp2)
    return mx.where(weights < _SMALLEST_NORMAL, mx.array(0, dtype=weights.dtype), weights), total


_SMALLEST_NORMAL = 2.0 ** -126  # float32's


def masked_softmax_for(num_scores: int, dtype: mx.Dtype) -> tuple[Softmax, float]:
    """The masked softmax a tile of `num_scores` scores takes (numpy's for large float32 tiles, else the
    power of two), and the factor its scores must carry: numpy's exp takes natural-log scores, the power
    of two log2 ones, and the queries' scale multiply folds it in."""
    if host_math.is_worth_it(num_scores, dtype):
        return host_math.unnormalized_softmax, 1.0
    return power_softmax, fast_math.LOG2E


def attention(q: mx.array, k: KV, v: KV, visible: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
    """attention.scaled_dot_product_attention's values as two grouped matmuls and the CPU's softmax."""
    B, L, H, _ = q.shape
    softmax, units = masked_softmax_for(H * B * L * visible.shape[-1], q.dtype)
    return grouped_query_attention(q, k, v, visible, scale, softmax, units, _matmul, sinks)


# Query rows per KV head (group * L) up to which int8 K/V multiply their codes. The CPU's quantized_matmul
# has no BLAS path, and many queries make the product compute-bound: 3x slower at 384 queries x 2k keys
# than dequantizing the tile's context first (measured); decodes still read a quarter of the bytes.
_QUANTIZED_MATMUL_MAX_ROWS = 64


def _matmul(x: mx.array, kv: KV, transpose: bool) -> mx.array:
    if not isinstance(kv, mx.array) and x.shape[-2] > _QUANTIZED_MATMUL_MAX_ROWS:
        kv = mx.dequantize(kv.codes, kv.scales, kv.biases, group_size=kv.group_size, bits=8)
    return portable_attention.matmul(x, kv, transpose)


# Scores per query tile of dense attention: 16 heads x 256 queries x 3,072 keys (an 896x672 image's full
# attention block) is 50 MB of float32, where one untiled [16, 3072, 3072] would be 600 MB.
_DENSE_TILE_SCORES = 1 << 24
_ALL_VISIBLE = mx.array(True)


def dense_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """mx.fast.scaled_dot_product_attention's values (q, k, v [B, H, L, D], no mask) as two matmuls and the
    CPU's softmax, tile by tile of queries. A vision tower's full-attention block over an 896x672 image's
    3,072 patches took 2.3-2.5 s in MLX's CPU sdpa (about 21 GFLOP/s) and 0.97 s this way (measured)."""
    B, H, L, _ = q.shape
    tile = max(1, _DENSE_TILE_SCORES // (B * H * k.shape[2]))
    outputs = []
    for start in range(0, L, tile):
        queries = q[:, :, start:start + tile]
        softmax, units = masked_softmax_for(B * H * queries.shape[2] * k.shape[2], q.dtype)
        weights, total = softmax((queries * (scale * units)) @ k.swapaxes(-1, -2), _ALL_VISIBLE)
        outputs.append((weights @ v) / total)
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=2)


KERNELS = Kernels("cpu", exp=fast_math.exp, sigmoid=fast_math.sigmoid, silu=fast_math.silu, silu_mul=silu_mul,
                  gelu_tanh_mul=gelu_tanh_mul, attention=attention, dense_attention=dense_attention,
                  prepare_float_model=linear.use_cpu_linears, step_cost=linear.step_cost,
                  step_threads=BlasThreads.of_process)
