"""The CPU's step backend: a single stream's decode row runs in numpy, outside MLX's graph.

Chosen once, when a runner is built on the CPU's kernels (ModelRunner.step_backend; the portable path never
builds it). Each step it lets the BLAS threads follow the cores other processes leave free
(ops/cpu/blas_threads.py), runs a step of one decode row here, and hands any other step to the graph.

Why, measured on a 2-core Xeon (AVX-512; mlx 0.32.4's CPU wheel, numpy 2.x with its own OpenBLAS; the
default 0.5B in float32; docs/perf-notes.md): a token reads 1.98 GB of weights, and numpy's gemv streams
them at 31-33 GB/s, so the linears alone take 60-62 ms. Through MLX's graph the same step took 110 ms:
its 169 gemvs ran at 26 GB/s between evaluations, and the ~25 ms of MLX ops between them (norms, RoPE,
the paged K/V write and gather, attention, activations) are dispatch, ~8 us an op, not arithmetic. Here
each of those is a numpy call on a vector (~1-2 us), and nothing waits on MLX until the logits.

It takes the model types whose stack is models/qwen2.py's (ROW_MODEL_TYPES: pre-norm DecoderLayers, then
the final norm and the head) with float32 weights, full-precision K/V of one piece a layer, and no tensor
parallelism; any other model's steps all stay in the graph. What it can read from the model it reads: each
linear's weight and bias, each norm's scale and eps, each RoPE's periods and attention factor, each MLP's
activation, the embedding lookup itself. What numpy cannot run is MLX's ops, so their numpy mirrors live in
ops/cpu/row_math.py, and `_run_layer` mirrors DecoderLayer.__call__. The pool is read in place through its
host view (ops/cpu/host_pool.py), taken fresh each step; the row's new K/V are written after it, through the
same call as the graph's (PagedKVCache.write), so the pool's arrays keep one writer. tests/test_cpu_row_step.py
checks every step against the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from tinymlx.kv.kv_cache import PagedKVCache
from tinymlx.models import CausalLM
from tinymlx.models.layers import gelu_tanh_mul, silu_mul
from tinymlx.ops.attention import first_visible_key
from tinymlx.ops.cpu import row_math
from tinymlx.ops.cpu.blas_threads import BlasThreads
from tinymlx.ops.cpu.host_pool import HostPool
from tinymlx.ops.cpu.linear import HostLinear
from tinymlx.runner.step_inputs import StepInputs

ROW_MODEL_TYPES = ("qwen2", "llama", "qwen3")  # models/qwen2.py's Model and qwen3.py's: one stack
_ACTIVATIONS = {silu_mul: row_math.silu_mul, gelu_tanh_mul: row_math.gelu_tanh_mul}  # an MLP's act -> numpy's

StepLogits = Callable[[StepInputs, mx.array | None], mx.array]  # (inputs, pending draws) -> sampled rows' logits


class _Norm(NamedTuple):
    scale: np.ndarray
    eps: float

    @classmethod
    def of(cls, norm: nn.Module) -> _Norm | None:
        return cls(np.asarray(norm.scale), norm.eps) if norm.weight.dtype == mx.float32 else None

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return row_math.rms_norm(x, self.scale, self.eps)


class _Layer(NamedTuple):
    input_norm: _Norm
    q: HostLinear
    k: HostLinear
    v: HostLinear
    qk_norms: tuple[_Norm, _Norm] | None
    rope: int  # index into _RowModel.periods
    attention_factor: float  # yarn's factor on q and k
    o: HostLinear
    post_norm: _Norm
    gate: HostLinear
    up: HostLinear
    down: HostLinear
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
    """ModelRunner.step_backend on the CPU's kernels (see the module's docstring). `graph`: the runner's
    step through the model's graph; `ready_pools`: grows the pool to the pages a step reaches and makes its staged writes."""

    def __init__(self, row_model: _RowModel | None, cache: PagedKVCache, windows: tuple[int | None, ...],
                 graph: StepLogits, ready_pools: Callable[[StepInputs], None], blas_threads: BlasThreads):
        self.row_model, self.cache, self.windows = row_model, cache, windows
        self.graph, self.ready_pools, self.blas_threads = graph, ready_pools, blas_threads

    @classmethod
    def of(cls, model: CausalLM, cache: PagedKVCache, windows: tuple[int | None, ...], graph: StepLogits,
           ready_pools: Callable[[StepInputs], None], takes_rows: bool = True) -> CPURowStep:
        """`takes_rows` False: every step through the graph (a runner that keeps its hidden states)."""
        row_model = _RowModel.of(model, cache) if takes_rows else None
        return cls(row_model, cache, windows, graph, ready_pools, BlasThreads.of_process())

    def __call__(self, inputs: StepInputs, pending: mx.array | None = None) -> mx.array:
        self.blas_threads.adapt()
        row = self._one_row(inputs, pending)
        if row is None:
            return self.graph(inputs, pending)
        self.ready_pools(inputs)
        return self.row_logits(row)

    def row_logits(self, row: RowInputs) -> mx.array:
        """Logits [1, vocab] of `row`'s token; its K/V land in the pool on the way, as the graph's would: through
        the pool's write, once the host view is gone (the step's evaluation makes the writes, in place)."""
        logits, new_kv = self.row_model.logits(row, HostPool(self.cache.pools), self.cache.block_size)
        slot_mapping = mx.array(row.slots[:, None])
        for layer, (k, v) in enumerate(new_kv):
            self.cache.write(layer, mx.array(k[None]), mx.array(v[None]), slot_mapping)
        return logits

    def release(self) -> None:
        """Let go of the model's weights and the BLAS threads (the runner is closing)."""
        self.row_model, self.graph = None, None
        self.blas_threads.restore()

    def _one_row(self, inputs: StepInputs, pending: mx.array | None) -> RowInputs | None:
        if self.row_model is None or inputs.tokens.size != 1 or inputs.sample_index.size != 1:
            return None
        token = int(inputs.tokens[0])
        if inputs.pending_rows is not None:  # the step before's draw (ModelRunner.start): wait for it
            token = pending[int(inputs.pending_rows[0, 1])].item()
        group = inputs.groups[0]
        return RowInputs(token, int(inputs.positions[0]), inputs.slot_mapping[:, 0],
                         tuple(table[0] for table in group.block_tables),
                         tuple(int(first[0]) for first in group.first_key_positions), self.windows)


class _RowModel(NamedTuple):
    """The model's modules as numpy runs one row through them."""

    embedding: nn.Module  # the model's own: its lookup of one token
    layers: list[_Layer]
    norm: _Norm
    head: HostLinear
    periods: list[np.ndarray]  # each distinct RoPE's periods (RoPE.periods), float64

    @classmethod
    def of(cls, model: CausalLM, cache: PagedKVCache) -> _RowModel | None:
        """None when the model has anything it does not run."""
        if model.args.model_type not in ROW_MODEL_TYPES or model.tensor_parallel_size != 1 or cache.layout.is_quantized:
            return None
        inner = model.model
        periods: dict[tuple[float, ...], int] = {}
        layers = [_layer(index, layer, cache, periods) for index, layer in enumerate(inner.layers)]
        head = HostLinear.of(inner.embed_tokens if model.args.tie_word_embeddings else model.lm_head)
        norm = _Norm.of(inner.norm)
        if None in layers or head is None or norm is None or HostLinear.of(inner.embed_tokens) is None:
            return None
        return cls(inner.embed_tokens, layers, norm, head, [np.array(p) for p in periods])

    def logits(self, row: RowInputs, pool: HostPool, block_size: int) -> tuple[mx.array, list[tuple[np.ndarray, ...]]]:
        """(the row's logits [1, vocab], each layer's new (K, V) [kv_heads, head_dim], for the pool)."""
        rotations = [row_math.rotation(row.position, periods) for periods in self.periods]
        context = [_context_slots(row, g, block_size) for g in range(len(row.windows))]
        h = np.array(self.embedding(mx.array([row.token]))[0])
        new_kv = []
        for layer in self.layers:
            h, k, v = _run_layer(layer, h, rotations[layer.rope], pool, context[layer.page_group])
            new_kv.append((k, v))
        return mx.array(self.head(self.norm(h))[None]), new_kv


def _layer(index: int, layer: nn.Module, cache: PagedKVCache, periods: dict[tuple[float, ...], int]) -> _Layer | None:
    """The layer as numpy runs it, or None where it holds anything numpy does not run (int8 or half weights,
    an activation without a numpy mirror, K/V in several pieces)."""
    attention, mlp, pieces = layer.self_attn, layer.mlp, cache.pieces_of_layer[index]
    if mlp.act not in _ACTIVATIONS or pieces is None or len(pieces.places) != 1 or pieces.columns != 1:
        return None
    linears = [HostLinear.of(m) for m in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj,
                                          mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
    norms = [_Norm.of(layer.input_layernorm), _Norm.of(layer.post_attention_layernorm)]
    qk_norms = None
    if "q_norm" in attention:
        qk_norms = (_Norm.of(attention.q_norm), _Norm.of(attention.k_norm))
        norms += qk_norms
    if None in linears or None in norms:
        return None
    q, k, v, o, gate, up, down = linears
    rope = periods.setdefault(tuple(np.array(attention.rope.periods, dtype=np.float64).tolist()), len(periods))
    return _Layer(norms[0], q, k, v, qk_norms, rope, attention.rope.attention_factor, o, norms[1], gate, up, down,
                  _ACTIVATIONS[mlp.act], attention.num_heads, attention.num_kv_heads, attention.head_dim,
                  attention.scale, pieces.page_groups[0], pieces.places[0])


def _context_slots(row: RowInputs, page_group: int, block_size: int) -> np.ndarray:
    """The pool slots of the keys the row's query sees in a page group before its own: from the first its
    window reaches (attention.visible_keys), up to the one before its position."""
    first_key, table = row.first_keys[page_group], row.block_tables[page_group]
    slots = (table[:, None].astype(np.int64) * block_size + np.arange(block_size)).reshape(-1)
    return slots[first_visible_key(row.position, row.windows[page_group]) - first_key:row.position - first_key]


def _run_layer(layer: _Layer, x: np.ndarray, rotation: tuple[np.ndarray, np.ndarray], pool: HostPool,
               context: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DecoderLayer's forward for one row x [hidden]: h = x + attn(norm(x)); h + mlp(norm(h)). Returns it and
    the row's K and V, which it attends to beside the context's but does not store."""
    normed = layer.input_norm(x)
    q = layer.q(normed).reshape(layer.num_heads, layer.head_dim)
    k = layer.k(normed).reshape(layer.num_kv_heads, layer.head_dim)
    v = layer.v(normed).reshape(layer.num_kv_heads, layer.head_dim)
    if layer.qk_norms is not None:
        q, k = layer.qk_norms[0](q), layer.qk_norms[1](k)
    if layer.attention_factor != 1.0:
        q, k = q * np.float32(layer.attention_factor), k * np.float32(layer.attention_factor)
    q, k = row_math.rotate(q, *rotation), row_math.rotate(k, *rotation)
    attended = row_math.attend(q, *pool.read_with(layer.place, context, k, v), layer.scale)
    h = x + layer.o(attended)
    normed = layer.post_norm(h)
    return h + layer.down(layer.activation(layer.gate(normed), layer.up(normed))), k, v
