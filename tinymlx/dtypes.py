"""The dtypes a model can be loaded in, and what "auto" means on this device (plain data, below the loader and models)."""

from __future__ import annotations

import mlx.core as mx

FLOAT_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
QUANT_BITS = {"q8": 8, "q4": 4}
QUANT_GROUP_SIZE = 64


def resolve_dtype(dtype: str) -> str:
    """'auto' picks what is fastest on the device: float32 on the CPU (BLAS), bfloat16 on a GPU."""
    if dtype != "auto":
        return dtype
    return "float32" if mx.default_device() == mx.cpu else "bfloat16"
