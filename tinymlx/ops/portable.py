"""The portable kernels: plain MLX, what a Mac's GPU runs (and the CPU under TINYMLX_PORTABLE=1), and the
interface every set of kernels fills (kernels.py picks one at load; the CPU's live in cpu/)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple, Protocol

import mlx.core as mx
import mlx.nn as nn

from tinymlx.ops.attention import scaled_dot_product_attention

Unary = Callable[[mx.array], mx.array]
Gated = Callable[[mx.array, mx.array], mx.array]


class StepThreads(Protocol):
    """What a runner's kernels do with their threads between steps (ModelRunner.step_threads)."""

    def adapt(self) -> None: ...  # before each step
    def restore(self) -> None: ...  # the runner is closing


class _NoStepThreads:
    """The portable kernels leave MLX's threads as they are."""

    def adapt(self) -> None:
        pass

    def restore(self) -> None:
        pass


NO_STEP_THREADS = _NoStepThreads()


class Kernels(NamedTuple):
    """The math model code calls through kernels.py; each set gives the same values to float32 rounding."""

    name: str  # "portable" | "cpu"
    exp: Unary
    sigmoid: Unary
    silu: Unary
    silu_mul: Gated  # silu(gate) * up, of one shape
    gelu_tanh_mul: Gated  # gelu_pytorch_tanh(gate) * up, of one shape
    attention: Callable[..., mx.array]  # (q, k, v, visible, scale, sinks=None): attention.py
    # (q, k, v [B, H, L, D], scale): every query sees every key (a vision tower's image or window)
    dense_attention: Callable[[mx.array, mx.array, mx.array, float], mx.array]
    # What a float model's linears become at load (load_model): the CPU's swaps in its own; here, nothing.
    prepare_float_model: Callable[[nn.Module], object]
    # A step's time relative to one row's, by rows: the prior of speculation's step-cost curve.
    step_cost: Callable[[int], float]
    # A runner's threads between steps: the CPU's follow the cores other processes leave free.
    step_threads: Callable[[], StepThreads]


# The gated MLP's activation is a step's largest elementwise op: compiled, it is one fused kernel instead of
# three passes over [tokens, hidden]. Shapeless: a step's token count changes every step (mlx-lm's swiglu).
@partial(mx.compile, shapeless=True)
def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


@partial(mx.compile, shapeless=True)
def gelu_tanh_mul(gate: mx.array, up: mx.array) -> mx.array:
    return nn.gelu_approx(gate) * up  # gelu_approx is the tanh form (gelu_pytorch_tanh)


def dense_attention(q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)


def keep_linears(model: nn.Module) -> None:
    """MLX's own linears are the portable ones."""


def step_cost(rows: int) -> float:
    """A step reads the weights once whatever its rows, up to a few dozen: a GPU's. On the CPU, MLX's sgemm
    read a weight at 12-13 GB/s for one row and 10-11 for a few (cpu/linear.py, cpu/rows_kernel.py)."""
    return 1.0 + 0.01 * (rows - 1) + 0.03 * max(0, rows - 32)


KERNELS = Kernels("portable", exp=mx.exp, sigmoid=mx.sigmoid, silu=nn.silu, silu_mul=silu_mul,
                  gelu_tanh_mul=gelu_tanh_mul, attention=scaled_dot_product_attention,
                  dense_attention=dense_attention, prepare_float_model=keep_linears, step_cost=step_cost,
                  step_threads=lambda: NO_STEP_THREADS)
