"""The CPU's step of one decode row: a single stream's forward in numpy, outside MLX's graph.

Why, measured on a 2-core Xeon (AVX-512; mlx 0.32.4's CPU wheel, numpy 2.x with its own OpenBLAS; the
default 0.5B in float32; docs/perf-notes.md): a token reads 1.98 GB of weights, and numpy's gemv streams
them at 31-33 GB/s, so the linears alone take 60-62 ms. Through MLX's graph the same step took 110 ms:
its 169 gemvs ran at 26 GB/s between evaluations, and the ~25 ms of MLX ops between them (norms, RoPE,
the paged K/V write and gather, attention, activations) are dispatch, ~8 us an op, not arithmetic. Here
each of those is a numpy call on a vector (~1-2 us), and nothing waits on MLX until the logits.

It runs what the graph runs for the models that say they are plain decoders (`CausalLM.is_plain_decoder`:
Qwen2, Llama, Qwen3) with float32 weights, full-precision K/V of one piece a layer, and no tensor parallelism:
`CPURowStep.of` returns None for any other model, whose steps stay in MLX. The pool is read and written in
place through its host view (kv_cache.HostPool), taken fresh each step. tests/test_cpu_row_step.py checks
every step against the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tinymlx.kv.kv_cache import HostPool, PagedKVCache
from tinymlx.models import CausalLM
from tinymlx.models.layers import MLP, RMSNorm, gelu_tanh_mul, silu_mul
from tinymlx.models.rope import RoPE
from tinymlx.ops import kernels
from tinymlx.ops.attention import first_visible_key
from tinymlx.ops.cpu import row_math
from tinymlx.ops.cpu.linear import CPUEmbedding, CPULinear

_ACTIVATIONS = {silu_mul: row_math.silu_mul, gelu_tanh_mul: row_math.gelu_tanh_mul}


class _Linear(NamedTuple):
    """x @ matrix (+ bias): the weight as numpy reads it in place (W.T of HF's [out, in], or input-major)."""

    matrix: np.ndarray
    bias: np.ndarray | None

    @classmethod
    def of(cls, module: nn.Module) -> _Linear | None:
        """A float32 linear (CPULinear in either layout, or nn.Linear), or a tied embedding read as the lm_head."""
        if type(module) not in (CPULinear, CPUEmbedding, nn.Linear, nn.Embedding):
            return None  # quantized, or an MoE block
        input_major = type(module) in (CPULinear, CPUEmbedding) and module.input_major
        weight = module.weight_t if input_major else module.weight
        if weight.dtype != mx.float32:  # numpy has no bfloat16, and half precision stays in MLX
            return None
        bias = np.asarray(module.bias) if "bias" in module else None
        return cls(np.asarray(weight) if input_major else np.asarray(weight).T, bias)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = x @ self.matrix  # a vector times a matrix: BLAS's gemv
        if self.bias is not None:
            y += self.bias
        return y


class _Norm(NamedTuple):
    weight: np.ndarray
    eps: float

    @classmethod
    def of(cls, module: nn.Module) -> _Norm | None:
        if type(module) is not RMSNorm or module.weight.dtype != mx.float32:
            return None
        return cls(np.asarray(module.weight + module.offset if module.offset else module.weight), module.eps)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return row_math.rms_norm(x, self.weight, self.eps)


class _Layer(NamedTuple):
    input_norm: _Norm
    q: _Linear
    k: _Linear
    v: _Linear
    qk_norms: tuple[_Norm, _Norm] | None
    rope: int  # index into CPURowStep.periods
    attention_factor: float  # yarn's factor on q and k
    o: _Linear
    post_norm: _Norm
    gate: _Linear
    up: _Linear
    down: _Linear
    activation: Callable[[np.ndarray, np.ndarray], np.ndarray]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    page_group: int  # whose slot and page table the layer's K/V take
    place: int  # which pool arrays hold them


class RowInputs(NamedTuple):
    """One decode row of a step, as host values (from the runner's StepInputs)."""

    token: int
    position: int
    slots: np.ndarray  # [page groups] the new token's K/V slot in each page group's pages
    block_tables: tuple[np.ndarray, ...]  # per page group: [pages read]
    first_keys: tuple[int, ...]  # per page group: the position of the first key those pages hold
    windows: tuple[int | None, ...]  # per page group: its sliding window (None: full attention)


class CPURowStep:
    """Logits of one decode row through numpy (see the module's docstring); built once per runner."""

    def __init__(self, embedding: nn.Module, layers: list[_Layer], norm: _Norm, head: _Linear,
                 periods: list[np.ndarray]):
        self.embedding, self.layers, self.norm, self.head, self.periods = embedding, layers, norm, head, periods

    @classmethod
    def of(cls, model: CausalLM, cache: PagedKVCache) -> CPURowStep | None:
        """The step for `model` over `cache`, or None when the model has anything it does not run."""
        inner = model.get("model")
        if (kernels.chosen().name != "cpu" or model.tensor_parallel_size != 1 or cache.layout.is_quantized
                or not model.is_plain_decoder or _Linear.of(inner.embed_tokens) is None):  # float32 rows
            return None
        periods: dict[tuple[float, ...], int] = {}
        layers = []
        for index, layer in enumerate(inner.layers):
            built = _layer(index, layer, cache, periods)
            if built is None:
                return None
            layers.append(built)
        head = _Linear.of(inner.embed_tokens if model.args.tie_word_embeddings else model.get("lm_head"))
        norm = _Norm.of(inner.norm)
        if head is None or norm is None:
            return None
        return cls(inner.embed_tokens, layers, norm, head, [np.array(p) for p in periods])

    def release(self) -> None:
        """Let go of the model's weights (the runner is closing)."""
        self.embedding, self.layers, self.head = None, [], None

    def logits(self, row: RowInputs, cache: PagedKVCache) -> mx.array:
        """Logits [1, vocab] of `row`'s token; its K/V land in the pool on the way, as the graph's would."""
        pool = cache.host_pool()
        rotations = [row_math.rotation(row.position, periods) for periods in self.periods]
        context = [_context_slots(row, g, cache.block_size) for g in range(len(row.windows))]
        h = self._embed(row.token)
        for layer in self.layers:
            h = _run_layer(layer, h, rotations[layer.rope], pool, row.slots[layer.page_group],
                           context[layer.page_group])
        return mx.array(self.head(self.norm(h))[None])

    def _embed(self, token: int) -> np.ndarray:
        if type(self.embedding) is CPUEmbedding and self.embedding.input_major:
            return np.asarray(self.embedding.weight_t)[:, token].copy()
        return np.asarray(self.embedding.weight)[token].copy()


def _layer(index: int, layer: nn.Module, cache: PagedKVCache, periods: dict[tuple[float, ...], int]) -> _Layer | None:
    """The layer as numpy runs it, or None where it holds anything else (sinks, an MoE block, int8 weights)."""
    if type(layer.mlp) is not MLP or layer.mlp.act not in _ACTIVATIONS:
        return None
    attention, mlp, pieces = layer.self_attn, layer.mlp, cache.pieces_of_layer[index]
    if "sinks" in attention or pieces is None or len(pieces.places) != 1 or pieces.columns != 1:
        return None
    linears = [_Linear.of(m) for m in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj,
                                      mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    norms = [_Norm.of(layer.input_layernorm), _Norm.of(layer.post_attention_layernorm)]
    qk_norms = None
    if "q_norm" in attention:
        qk_norms = (_Norm.of(attention.q_norm), _Norm.of(attention.k_norm))
        norms += qk_norms
    if None in linears or None in norms:
        return None
    q, k, v, o, gate, up, down = linears
    rope_periods = tuple(_periods(attention.rope).tolist())
    rope = periods.setdefault(rope_periods, len(periods))
    return _Layer(norms[0], q, k, v, qk_norms, rope, attention.rope.attention_factor, o, norms[1], gate, up, down,
                  _ACTIVATIONS[mlp.act], attention.num_heads, attention.num_kv_heads, attention.head_dim,
                  attention.scale, pieces.page_groups[0], pieces.places[0])


def _periods(rope: RoPE) -> np.ndarray:
    """mx.fast.rope's period of each rotated pair, float64: its base ** (2i / dims) or its freqs, over its scale."""
    if rope.freqs is not None:
        wavelengths = np.array(rope.freqs, dtype=np.float64)
    else:
        wavelengths = np.float64(rope.base) ** (np.arange(0, rope.dims, 2, dtype=np.float64) / rope.dims)
    return wavelengths / rope.scale


def _context_slots(row: RowInputs, page_group: int, block_size: int) -> np.ndarray:
    """The pool slots of the keys the row's query sees in a page group: up to its own position, and in a
    window W only the last W (attention.visible_keys)."""
    first_key, table = row.first_keys[page_group], row.block_tables[page_group]
    slots = (table[:, None].astype(np.int64) * block_size + np.arange(block_size)).reshape(-1)
    return slots[first_visible_key(row.position, row.windows[page_group]) - first_key:row.position - first_key + 1]


def _run_layer(layer: _Layer, x: np.ndarray, rotation: tuple[np.ndarray, np.ndarray], pool: HostPool, slot: int,
               context: np.ndarray) -> np.ndarray:
    """DecoderLayer's forward for one row x [hidden]: h = x + attn(norm(x)); h + mlp(norm(h))."""
    normed = layer.input_norm(x)
    q = layer.q(normed).reshape(layer.num_heads, layer.head_dim)
    k = layer.k(normed).reshape(layer.num_kv_heads, layer.head_dim)
    v = layer.v(normed).reshape(layer.num_kv_heads, layer.head_dim)
    if layer.qk_norms is not None:
        q, k = layer.qk_norms[0](q), layer.qk_norms[1](k)
    if layer.attention_factor != 1.0:
        q, k = q * np.float32(layer.attention_factor), k * np.float32(layer.attention_factor)
    q, k = row_math.rotate(q, *rotation), row_math.rotate(k, *rotation)
    pool.write(layer.place, slot, k, v)
    attended = row_math.attend(q, *pool.read(layer.place, context), layer.scale)
    h = x + layer.o(attended)
    normed = layer.post_norm(h)
    return h + layer.down(layer.activation(layer.gate(normed), layer.up(normed)))
