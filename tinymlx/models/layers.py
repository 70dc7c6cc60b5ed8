"""Building blocks the families share: RMSNorm, attention over flat tokens, gated MLPs, the float32 CPU linear.

Each block that holds linears knows how it splits under tensor parallelism (`shard`): q/k/v and
gate/up keep whole heads / FFN columns, o_proj and down_proj sum their partial outputs over the
ranks (see sharding.py). The MoE block lives in moe.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from tinymlx.models.base import AttentionBackend
from tinymlx.models.rope import RoPE
from tinymlx.models.sharding import shard_input_features, shard_output_features
from tinymlx.ops import kernels


def only_rows(h: mx.array, rows: mx.array | None) -> mx.array:
    """The rows of h the step samples from, where a last layer's MLP need not run on the others."""
    return h if rows is None else h[rows]


def run_layers(layers: list[nn.Module], h: mx.array, positions: mx.array, attention: AttentionBackend,
               rows: mx.array | None) -> mx.array:
    """h through every decoder layer; only the last one is given `rows` (see CausalLM.__call__)."""
    *inner, last = layers
    for layer in inner:
        h = layer(h, positions, attention)
    return last(h, positions, attention, rows)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis; Gemma stores its weight as an offset from 1 (`offset=1.0`)."""

    def __init__(self, dims: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.weight = mx.zeros((dims,)) if offset else mx.ones((dims,))
        self.eps, self.offset = eps, offset

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight + self.offset if self.offset else self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention over flat tokens with RoPE; optional q/k/v bias and per-head q/k RMSNorm
    (applied before RoPE); `scale` is the family's (1/sqrt(head_dim) unless it says otherwise)."""

    def __init__(self, layer: int, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, rope: RoPE,
                 scale: float | None = None, bias: bool = False, out_bias: bool = False,
                 qk_norm: Callable[[int], nn.Module] | None = None):
        super().__init__()
        self.layer, self.num_heads, self.num_kv_heads, self.head_dim = layer, num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=out_bias)
        if qk_norm is not None:
            self.q_norm, self.k_norm = qk_norm(head_dim), qk_norm(head_dim)
        self.rope = rope

    def __call__(self, x: mx.array, positions: mx.array, attention: AttentionBackend) -> mx.array:
        N, _ = x.shape
        q = self.q_proj(x).reshape(N, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(N, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(N, self.num_kv_heads, self.head_dim)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, positions), self.rope(k, positions)
        out = attention(self.layer, q, k, v, self.scale)
        return self.o_proj(out.reshape(N, -1))

    def shard(self, group: mx.distributed.Group, all_reduce: Callable[[mx.array], mx.array]) -> None:
        """Whole heads per rank (q/k norms act per head, so they stay whole); one all-reduce after o_proj."""
        for name in ("q_proj", "k_proj", "v_proj"):
            shard_output_features(self, name, group)
        self.num_heads //= group.size()
        self.num_kv_heads //= group.size()
        shard_input_features(self, "o_proj", group, all_reduce)


# Gated activations, act(gate) * up: the chosen kernels' (ops/kernels.py).
silu_mul, gelu_tanh_mul = kernels.silu_mul, kernels.gelu_tanh_mul
ACTIVATIONS = {"silu": silu_mul, "gelu_pytorch_tanh": gelu_tanh_mul, "gelu_tanh": gelu_tanh_mul}


def activation(name: str) -> Callable[[mx.array, mx.array], mx.array]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported activation {name!r} (supported: {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class MLP(nn.Module):
    """A gated MLP: down(act(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden_dim: int, act: Callable[[mx.array, mx.array], mx.array] = silu_mul):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.act = act

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))

    def shard(self, group: mx.distributed.Group, all_reduce: Callable[[mx.array], mx.array]) -> None:
        for name in ("gate_proj", "up_proj"):
            shard_output_features(self, name, group)
        shard_input_features(self, "down_proj", group, all_reduce)


class InputMajorLinear(nn.Module):
    """nn.Linear with its float weight stored transposed, [in, out], for BLAS.

    Which layout OpenBLAS multiplies faster depends on the machine. On the 2-core EPYC this was written
    on, x @ W beat x @ W.T at M = 1 and 32: the 151,936-wide lm_head 1.3-1.8x, gate/up 1.15-1.25x, q/o
    level, down_proj 10-15% slower. On a 2-core Xeon the other way: a decode step's matmuls 186-203 ms
    this way against 140 ms in HF's layout, the lm_head 49 against 39 ms. So `use_input_major_linears`
    times both for each shape once, at load, and keeps the faster. Checkpoints keep HF's [out, in].
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight_t = mx.contiguous(linear.weight.T)
        if "bias" in linear:
            self.bias = linear.bias

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self.weight_t
        return y + self.bias if "bias" in self else y


class InputMajorEmbedding(nn.Module):
    """A tied nn.Embedding stored transposed, [dims, vocab]. As the lm_head (x @ W^T, every step) that is
    BLAS's fast layout: measured 1.4x at M = 1 and 1.8x at M = 16 for a 248k vocabulary. A lookup gathers
    columns instead of rows (10 ms for a 512-token chunk, once per chunk)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__()
        self.weight_t = mx.contiguous(embedding.weight.T)

    def __call__(self, tokens: mx.array) -> mx.array:
        return mx.take(self.weight_t, tokens, axis=1).T

    def as_linear(self, x: mx.array) -> mx.array:
        return x @ self.weight_t


LINEAR_LAYOUT_ENV = "TINYMLX_LINEAR_LAYOUT"  # "input_major" or "hf" pins the layout; unset: measured
LINEAR_LAYOUTS = ("input_major", "hf")


def use_input_major_linears(model: nn.Module) -> dict[tuple[int, int], bool]:
    """For float32 on the CPU, where matmuls run in BLAS: swap each float nn.Linear for an InputMajorLinear,
    and a tied embedding (the lm_head too) for an InputMajorEmbedding, where that layout multiplies one row
    faster on this machine (timed once per weight shape; TINYMLX_LINEAR_LAYOUT pins either). A
    tensor-parallel rank's tied embedding stays as it is: its lm_head reads a slice of its rows
    (sharding.embedding_rows_as_linear). Returns {(out, in): input-major chosen}."""
    pinned = os.environ.get(LINEAR_LAYOUT_ENV) or None
    if pinned is not None and pinned not in LINEAR_LAYOUTS:
        raise ValueError(f"{LINEAR_LAYOUT_ENV} must be one of {LINEAR_LAYOUTS}, got {pinned!r}")
    chosen: dict[tuple[int, int], bool] = {}

    def input_major(weight: mx.array) -> bool:
        if weight.shape not in chosen:
            chosen[weight.shape] = pinned == "input_major" if pinned else _input_major_is_faster(weight)
        return chosen[weight.shape]

    def convert(_path: str, module: nn.Module) -> nn.Module:
        if type(module) is not nn.Linear or not input_major(module.weight):
            return module
        converted = InputMajorLinear(module)
        mx.eval(converted.parameters())
        module.pop("weight")  # free the [out, in] copy now: memory grows by one layer, not by the model
        return converted

    model.update_modules(tree_map_with_path(convert, model.leaf_modules(), is_leaf=nn.Module.is_module))
    embedding = model.model.embed_tokens
    if (model.args.tie_word_embeddings and model.tensor_parallel_size == 1 and type(embedding) is nn.Embedding
            and input_major(embedding.weight)):
        model.model.embed_tokens = InputMajorEmbedding(embedding)
        mx.eval(model.model.embed_tokens.parameters())
        embedding.pop("weight")
    return chosen


def _input_major_is_faster(weight: mx.array, repeats: int = 5) -> bool:
    """Whether one row (a decode step's) multiplies faster through an [in, out] copy of `weight` than through
    `weight` [out, in] transposed: the best of `repeats` timings of each, after one warm-up."""
    row = mx.ones((1, weight.shape[1]), dtype=weight.dtype)
    weight_t = mx.contiguous(weight.T)

    def best(multiply: Callable[[], mx.array]) -> float:
        mx.eval(multiply())
        timings = []
        for _ in range(repeats):
            started = time.perf_counter()
            mx.eval(multiply())
            timings.append(time.perf_counter() - started)
        return min(timings)

    return best(lambda: row @ weight_t) < best(lambda: row @ weight.T)
