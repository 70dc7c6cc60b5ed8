"""The math model code calls, from one set of kernels chosen once at load: the portable ones (plain MLX,
what a Mac runs: portable.py) or the CPU's (cpu/). Model code calls the functions below and never asks
which device it runs on.

The choice is the process's, like MLX's default device it follows: `choose()` makes it when a model is
built (models.build_model), from the device and TINYMLX_PORTABLE=1 (the CPU runs the portable path; CI
runs the parity tests through both). A GPU never takes the CPU's kernels.
"""

from __future__ import annotations

import os

import mlx.core as mx

from tinymlx.ops import cpu, portable
from tinymlx.ops.attention import KV
from tinymlx.ops.portable import Kernels

PORTABLE_ENV = "TINYMLX_PORTABLE"


def choose(force_portable: bool | None = None) -> Kernels:
    """Pick and keep this process's kernels: the CPU's on the CPU, unless `force_portable` (None: the
    environment's TINYMLX_PORTABLE=1) asks for the portable ones; the portable ones on any other device."""
    if force_portable is None:
        force_portable = os.environ.get(PORTABLE_ENV, "0") not in ("", "0")
    return use(portable.KERNELS if force_portable or mx.default_device() != mx.cpu else cpu.KERNELS)


def use(choice: Kernels) -> Kernels:
    """Keep `choice` (choose() picks it; a test or a benchmark sets one, then restores what it found)."""
    global _chosen
    _chosen = choice
    return choice


def chosen() -> Kernels:
    return _chosen


# What model code calls: each forwards to the chosen kernels.
def exp(x: mx.array) -> mx.array:
    return _chosen.exp(x)


def sigmoid(x: mx.array) -> mx.array:
    return _chosen.sigmoid(x)


def silu(x: mx.array) -> mx.array:
    return _chosen.silu(x)


def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    return _chosen.silu_mul(gate, up)


def gelu_tanh_mul(gate: mx.array, up: mx.array) -> mx.array:
    return _chosen.gelu_tanh_mul(gate, up)


def attention(q: mx.array, k: KV, v: KV, visible: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
    return _chosen.attention(q, k, v, visible, scale, sinks)


def dense_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    """q, k, v [B, H, L, D] -> [B, H, L, D]: every query sees every key (a vision tower's image or window)."""
    return _chosen.dense_attention(q, k, v, scale)


_chosen: Kernels
choose()  # at import too, so that a bare function call (a unit test, a benchmark) has kernels
