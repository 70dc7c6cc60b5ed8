"""How one token's K or V of one KV head is stored in the paged pool (plain data, below config and kv_cache).

    "auto": head_dim values in the model's activation dtype (float32 on the CPU, bfloat16 on a GPU)
    "int8": head_dim 8-bit codes, with a scale and a bias (in the activation dtype) per group of up to
            128 values: MLX's affine quantization (w = scale * q + bias), so attention multiplies the
            codes directly (mx.quantized_matmul) and never dequantizes the context
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

KV_CACHE_DTYPES = ("auto", "int8")
_GROUP_SIZES = (128, 64, 32)  # the group sizes mx.quantize supports, widest first
KV_BITS = 8


@dataclass(frozen=True)
class KVLayout:
    head_dim: int
    dtype: mx.Dtype  # the activation dtype: a full-precision pool's, an int8 pool's scales and biases
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.is_quantized and self.group_size is None:
            raise ValueError(f"kv_cache_dtype='int8' needs a head_dim that is a multiple of 32, got {self.head_dim}")

    @property
    def is_quantized(self) -> bool:
        return self.kv_cache_dtype == "int8"

    @property
    def group_size(self) -> int | None:
        """Values sharing one scale and bias: the whole head where MLX allows it (one pair per token and head)."""
        return next((size for size in _GROUP_SIZES if self.head_dim % size == 0), None)

    @property
    def widths(self) -> tuple[tuple[int, mx.Dtype], ...]:
        """(last-axis width, dtype) of each pool array kept for K (and again for V): the values, or
        the packed codes (four per uint32) and their scales and biases."""
        if not self.is_quantized:
            return ((self.head_dim, self.dtype),)
        groups = self.head_dim // self.group_size
        return ((self.head_dim * KV_BITS // 32, mx.uint32), (groups, self.dtype), (groups, self.dtype))

    @property
    def bytes_per_token_head(self) -> int:
        """Bytes one token's K and V take in one KV head of one layer."""
        return 2 * sum(width * dtype.size for width, dtype in self.widths)
