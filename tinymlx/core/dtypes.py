"""The dtypes a model can be loaded in, and what "auto" means on this device (plain data, below the loader and models).

"native" keeps a checkpoint's quantization as it is: a GGUF's own quant types mapped onto MLX's quantized
layers (loader/gguf_quant.py), an MLX-quantized checkpoint as published; its float tensors, and the
quantization scales, take NATIVE_FLOAT_DTYPES' dtype for the device. A float checkpoint loads in that dtype.
"""

from __future__ import annotations

import os

import mlx.core as mx

FLOAT_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
QUANT_BITS = {"q8": 8, "q4": 4}
QUANT_GROUP_SIZE = 64
# "auto" on the CPU keeps float32, BLAS's fast path (quantized matmuls there are 4-5x slower: docs/perf-notes.md),
# while the float32 weights take at most this share of RAM; a bigger model loads "native".
AUTO_FLOAT32_RAM_FRACTION = 0.5


def native_float_dtype() -> mx.Dtype:
    """The dtype of a "native" model's float tensors and scales: float32 on the CPU, where it keeps every
    exact GGUF mapping exact (gguf_quant.py) and matmuls run in BLAS; bfloat16 on a GPU."""
    return mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16


def resolve_dtype(dtype: str, num_float32_bytes: int | None = None) -> str:
    """'auto' picks what is fastest on the device that holds the model: "native" on a GPU; on the CPU,
    float32 (BLAS) unless the model's float32 weights, `num_float32_bytes` (None: unknown, taken to fit),
    exceed AUTO_FLOAT32_RAM_FRACTION of RAM: then "native"."""
    if dtype != "auto":
        return dtype
    if mx.default_device() != mx.cpu:
        return "native"
    ram = ram_bytes()
    if num_float32_bytes is not None and ram is not None and num_float32_bytes > AUTO_FLOAT32_RAM_FRACTION * ram:
        return "native"
    return "float32"


def ram_bytes() -> int | None:
    """Physical memory of this machine (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
