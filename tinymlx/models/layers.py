"""Building blocks the families share: RMSNorm, attention over flat tokens, gated MLPs.

Each block that holds linears knows how it splits under tensor parallelism (`shard`): q/k/v and
gate/up keep whole heads / FFN columns, o_proj and down_proj sum their partial outputs over the
ranks (see sharding.py). The MoE block lives in moe.py.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from tinymlx.models.base import AttentionBackend
from tinymlx.models.rope import RoPE
from tinymlx.models.sharding import shard_input_features, shard_output_features
from tinymlx.ops import kernels


def only_rows(h: mx.array, rows: mx.array | None) -> mx.array:
    """The rows of h the step samples from, where a last layer's MLP need not run on the others."""
    return h if rows is None else h[rows]


def run_layers(layers: list[nn.Module | None], h: mx.array, positions: mx.array, attention: AttentionBackend,
               rows: mx.array | None) -> mx.array:
    """h through every decoder layer held here (a pipeline stage's others are None); only the last one is
    given `rows` (see CausalLM.__call__)."""
    *inner, last = [layer for layer in layers if layer is not None]
    for layer in inner:
        h = layer(h, positions, attention)
    return last(h, positions, attention, rows)


def finish_stage(model: nn.Module, h: mx.array, positions: mx.array, attention: AttentionBackend,
                 rows: mx.array | None) -> mx.array:
    """A decoder stack's layers and final norm over h; a pipeline stage before the last (model.stage) returns
    every row's hidden states before the norm, for the next stage."""
    if not model.stage.is_last:
        return run_layers(model.layers, h, positions, attention, None)
    return model.norm(run_layers(model.layers, h, positions, attention, rows))


class RMSNorm(nn.Module):
    """RMSNorm over the last axis; Gemma stores its weight as an offset from 1 (`offset=1.0`)."""

    def __init__(self, dims: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.weight = mx.zeros((dims,)) if offset else mx.ones((dims,))
        self.eps, self.offset = eps, offset

    @property
    def scale(self) -> mx.array:
        """What the normalised x is multiplied by: the weight (plus Gemma's offset)."""
        return self.weight + self.offset if self.offset else self.weight

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.scale, self.eps)


class Attention(nn.Module):
    """Grouped-query attention over flat tokens with RoPE; optional q/k/v bias, per-head q/k RMSNorm
    (applied before RoPE) and per-head sinks (a learned logit in every softmax: gpt-oss); `scale` is the
    family's (1/sqrt(head_dim) unless it says otherwise)."""

    def __init__(self, layer: int, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, rope: RoPE,
                 scale: float | None = None, bias: bool = False, out_bias: bool = False,
                 qk_norm: Callable[[int], nn.Module] | None = None, sinks: bool = False):
        super().__init__()
        self.layer, self.num_heads, self.num_kv_heads, self.head_dim = layer, num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, dim, bias=out_bias)
        if qk_norm is not None:
            self.q_norm, self.k_norm = qk_norm(head_dim), qk_norm(head_dim)
        if sinks:
            self.sinks = mx.zeros((num_heads,))
        self.rope = rope

    def __call__(self, x: mx.array, positions: mx.array, attention: AttentionBackend) -> mx.array:
        N, _ = x.shape
        q = self.q_proj(x).reshape(N, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(N, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(N, self.num_kv_heads, self.head_dim)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rope(q, positions), self.rope(k, positions)
        out = attention(self.layer, q, k, v, self.scale, self.get("sinks"))
        return self.o_proj(out.reshape(N, -1))

    def shard(self, group: mx.distributed.Group, all_reduce: Callable[[mx.array], mx.array]) -> None:
        """Whole heads per rank (q/k norms act per head, so they stay whole; sinks go with their heads); one
        all-reduce after o_proj."""
        for name in ("q_proj", "k_proj", "v_proj"):
            shard_output_features(self, name, group)
        if "sinks" in self:
            per_rank = self.num_heads // group.size()
            self.sinks = self.sinks[group.rank() * per_rank:(group.rank() + 1) * per_rank]
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
