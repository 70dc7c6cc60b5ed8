"""The CPU's float32 linears: one row multiplies through numpy's gemv, 2-8 rows over HF's layout through
the few-row kernels (rows_kernel.py says why), more rows through MLX's matmul.

Why, measured on a 2-core Xeon (AVX-512; mlx 0.32.4's CPU wheel with Debian's OpenBLAS preloaded, numpy
2.x with its own OpenBLAS 0.3.31; docs/perf-notes.md):
- One row (a single stream's decode step) only streams the weight, and MLX's CPU matmul calls sgemm for
  it, which read a [4864, 896] float32 weight at 12-13 GB/s; numpy's matmul of one row calls sgemv, which
  read it at 26-29 GB/s (the 151,936-wide lm_head in 19-20 ms against 44). Each such linear first
  evaluates its input on the host (~10 us plus the ops pending), which a step of more rows does not pay.
  End to end the default 0.5B's single stream decoded at 9.8 tok/s against 6.3 with every matmul in MLX.
- For more rows the layout is a per-machine choice: on the 2-core EPYC this project began on, x @ W for
  an [in, out] copy beat x @ W.T 1.3-1.8x for the lm_head and 1.15-1.25x for gate/up; on the Xeon HF's
  [out, in] was level or up to 17% faster. So each weight shape is timed both ways at load, at
  `LAYOUT_ROWS` rows, and keeps the faster; TINYMLX_LINEAR_LAYOUT pins one. Checkpoints keep HF's. Where
  the few-row kernels exist (numba: Linux), every weight keeps HF's layout, which they read: up to 8 rows
  they beat sgemm in either layout 1.6-2.3x, past 8 the layouts differed by at most 17% on the Xeon.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from tinymlx.ops.cpu import host_math, rows_kernel

LINEAR_LAYOUT_ENV = "TINYMLX_LINEAR_LAYOUT"  # "input_major" or "hf" pins the layout; unset: measured
LINEAR_LAYOUTS = ("input_major", "hf")
LAYOUT_ROWS = 8  # a batch of decodes: one row goes to numpy's gemv either way


class _LaidOutWeight(nn.Module):
    """A float32 weight W [out, in], stored as it is (HF's layout) or as W.T [in, out] (input-major)."""

    def __init__(self, weight: mx.array, input_major: bool):
        super().__init__()
        if input_major:
            self.weight_t = mx.contiguous(weight.T)
        else:
            self.weight = weight

    @property
    def input_major(self) -> bool:
        return "weight_t" in self


class CPULinear(_LaidOutWeight):
    """nn.Linear's values for a float32 weight on the CPU."""

    def __init__(self, linear: nn.Linear, input_major: bool):
        super().__init__(linear.weight, input_major)
        if "bias" in linear:
            self.bias = linear.bias

    def __call__(self, x: mx.array) -> mx.array:
        return _times_weight(x, self, self.get("bias"))


class CPUEmbedding(_LaidOutWeight):
    """A tied nn.Embedding whose `as_linear` is the lm_head. Input-major, a lookup gathers columns instead of
    rows (10 ms for a 512-token chunk, once per chunk)."""

    def __init__(self, embedding: nn.Embedding, input_major: bool):
        super().__init__(embedding.weight, input_major)

    def __call__(self, tokens: mx.array) -> mx.array:
        return mx.take(self.weight_t, tokens, axis=1).T if self.input_major else self.weight[tokens]

    def as_linear(self, x: mx.array) -> mx.array:
        return _times_weight(x, self, None)


def _times_weight(x: mx.array, module: _LaidOutWeight, bias: mx.array | None) -> mx.array:
    """x @ W.T (+ bias): numpy's gemv for one float32 row, the few-row kernels for 2-8 over HF's layout
    (rows_kernel.py), else MLX's matmul in the module's layout."""
    input_major = module.input_major
    if host_math.is_one_row(x):
        return host_math.row_times(x, module.weight_t if input_major else module.weight, input_major, bias)
    if not input_major and host_math.is_few_rows(x):
        return host_math.rows_times(x, module.weight, bias)
    y = x @ (module.weight_t if input_major else module.weight.T)
    return y if bias is None else y + bias


def pinned_layout() -> str | None:
    pinned = os.environ.get(LINEAR_LAYOUT_ENV) or None
    if pinned is not None and pinned not in LINEAR_LAYOUTS:
        raise ValueError(f"{LINEAR_LAYOUT_ENV} must be one of {LINEAR_LAYOUTS}, got {pinned!r}")
    return pinned


def layout_is_input_major(weight: mx.array, pinned: str | None) -> bool:
    """Whether `weight` is kept input-major: as `pinned` (pinned_layout()) says; else HF's where the few-row
    kernels exist; else as measured on this machine."""
    if pinned is not None:
        return pinned == "input_major"
    return False if rows_kernel.available() else input_major_is_faster(weight)


def input_major_is_faster(weight: mx.array, repeats: int = 5) -> bool:
    """Whether `LAYOUT_ROWS` rows multiply faster through an [in, out] copy of `weight` than through `weight`
    [out, in] transposed: the best of `repeats` timings of each, after one warm-up."""
    rows = mx.ones((LAYOUT_ROWS, weight.shape[1]), dtype=weight.dtype)
    weight_t = mx.contiguous(weight.T)

    def best(multiply: Callable[[], mx.array]) -> float:
        mx.eval(multiply())
        timings = []
        for _ in range(repeats):
            started = time.perf_counter()
            mx.eval(multiply())
            timings.append(time.perf_counter() - started)
        return min(timings)

    return best(lambda: rows @ weight_t) < best(lambda: rows @ weight.T)


def use_cpu_linears(model: nn.Module) -> dict[tuple[int, int], bool]:
    """A float model's linears as the CPU's kernels run them (load_model, through `Kernels.prepare_float_model`):
    each float nn.Linear becomes a CPULinear, and a tied embedding (the lm_head too) a CPUEmbedding, each in its
    layout (`layout_is_input_major`: chosen once per weight shape; TINYMLX_LINEAR_LAYOUT pins either). A
    tensor-parallel rank's tied embedding stays as it is: its lm_head reads a slice of its rows
    (models/sharding.py embedding_rows_as_linear). Returns {(out, in): input-major chosen}."""
    pinned = pinned_layout()
    chosen: dict[tuple[int, int], bool] = {}

    def input_major(weight: mx.array) -> bool:
        if weight.shape not in chosen:
            chosen[weight.shape] = layout_is_input_major(weight, pinned)
        return chosen[weight.shape]

    towers = getattr(model, "tower_prefixes", ())

    def convert(path: str, module: nn.Module) -> nn.Module:
        if type(module) is not nn.Linear or path.startswith(towers):  # towers stay plain MLX (many rows: sgemm)
            return module
        converted = CPULinear(module, input_major(module.weight))
        mx.eval(converted.parameters())
        module.pop("weight")  # free the [out, in] copy now: memory grows by one layer, not by the model
        return converted

    model.update_modules(tree_map_with_path(convert, model.leaf_modules(), is_leaf=nn.Module.is_module))
    rows_kernel.warm_up()
    embedding = model.model.get("embed_tokens")  # a pipeline stage between the first and last holds none
    if model.args.tie_word_embeddings and model.tensor_parallel_size == 1 and type(embedding) is nn.Embedding:
        model.model.embed_tokens = CPUEmbedding(embedding, input_major(embedding.weight))
        mx.eval(model.model.embed_tokens.parameters())
        embedding.pop("weight")
    return chosen


def step_cost(rows: int) -> float:
    """A step's time relative to one row's through these linears (docs/perf-notes.md): the measure of every
    linear layer of the 0.5B model in float32, one row through numpy's gemv, 2-8 through the few-row kernels
    (rows_kernel.py), more through OpenBLAS's sgemm. Up to 8 rows cost little more than one. The prior of
    speculation's step-cost curve (speculative/step_cost.py)."""
    measured = {1: 1.0, 2: 1.35, 3: 1.39, 4: 1.41, 5: 1.64, 6: 1.66, 8: 1.61, 12: 3.43, 16: 2.72}
    if rows >= 16:
        return measured[16] + 0.06 * (rows - 16)
    below = max(m for m in measured if m <= rows)
    above = min(m for m in measured if m >= rows)
    if below == above:
        return measured[rows]
    return measured[below] + (measured[above] - measured[below]) * (rows - below) / (above - below)
