"""The kinds of state a model's layers keep (plain data: models declare them, the KV cache sizes and
pages them, the runner hands each layer what its kind needs)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class FullAttention:
    """K/V of every token, in the paged pool: a query at position p sees keys 0..p. `kv_heads` and
    `head_dim`: this layer's own K/V shape, where a model's layers differ (Gemma 4's global layers: 512 wide,
    its sliding ones 256); None: the model's (every layer alike)."""

    kv_heads: int | None = None
    head_dim: int | None = None


@dataclass(frozen=True)
class SlidingWindow:
    """K/V of the last `window` tokens: a query at position p sees keys p-window+1..p (transformers'
    convention: key k is visible when k > p - window). `kv_heads`, `head_dim` as for FullAttention."""

    window: int
    kv_heads: int | None = None
    head_dim: int | None = None


@dataclass(frozen=True)
class Recurrent:
    """A fixed-size state per sequence, whatever its length (Gated DeltaNet): the last `kernel - 1` inputs
    of a short causal convolution over `conv_dim` channels, and a delta-rule state [heads, key_dim, value_dim]."""

    kernel: int
    conv_dim: int
    heads: int
    key_dim: int
    value_dim: int

    @property
    def num_state_floats(self) -> int:
        """float32 values of one sequence's state in one layer."""
        return (self.kernel - 1) * self.conv_dim + self.heads * self.key_dim * self.value_dim


@dataclass(frozen=True)
class SharedKV:
    """No state of its own: the layer attends over the K/V layer `source` keeps (Gemma 3n/4's KV-shared
    layers), through that layer's pages and with its mask. It takes no blocks and no pool bytes; prefix hits,
    preemption and sizing see only `source`'s group."""

    source: int


LayerSpec = FullAttention | SlidingWindow | Recurrent | SharedKV
Attends = FullAttention | SlidingWindow  # the kinds that keep K/V of their own


def kv_groups(specs: tuple[LayerSpec, ...]) -> tuple[tuple[LayerSpec, tuple[int, ...]], ...]:
    """Layers of one kind of K/V (full, each window; each K/V shape) form a group, in order of first
    appearance: ((spec, layers), ...). Recurrent and shared-KV layers keep no K/V of their own: they are in
    no KV group (see `recurrent_layers`, `kv_source`)."""
    groups: dict[LayerSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        if isinstance(spec, FullAttention | SlidingWindow):
            groups.setdefault(spec, []).append(layer)
    return tuple((spec, tuple(layers)) for spec, layers in groups.items())


def kv_source(specs: tuple[LayerSpec, ...], layer: int) -> int:
    """The layer whose K/V `layer` reads: its own, or a shared-KV layer's source (which keeps its own)."""
    spec = specs[layer]
    return spec.source if isinstance(spec, SharedKV) else layer  # a source keeps K/V: core/refusals.py


def attending_spec(specs: tuple[LayerSpec, ...], layer: int) -> LayerSpec:
    """The kind of attention `layer` does: its own spec, or its source's (its window, its mask)."""
    return specs[kv_source(specs, layer)]


# -- the shared pool's pages -------------------------------------------------------------------------
#
# Layers whose K/V shapes differ (kv_heads x head_dim) are stored as pieces of one common shape, the gcd
# of the heads and of the widths: Gemma 4 E2B's global layers (1 x 512) are two pieces of 1 x 256, its
# sliding layers one. A piece is what a "layer" was to the pool: a page holds block_size tokens of K/V in
# `pool_block_layers` pieces, every page is the same size, and a group's block costs its pieces over that.
# No byte is padding: a 512-wide layer takes exactly twice a 256-wide one's pages.

def kv_piece_shape(groups: tuple[tuple[LayerSpec, tuple[int, ...]], ...],
                   default: tuple[int, int]) -> tuple[int, int]:
    """(kv_heads, head_dim) of one piece: the model's `default` where every layer has it."""
    shapes = {_shape(spec, default) for spec, _ in groups} or {default}
    return math.gcd(*(h for h, _ in shapes)), math.gcd(*(d for _, d in shapes))


def kv_pieces(groups: tuple[tuple[LayerSpec, tuple[int, ...]], ...], default: tuple[int, int]) -> tuple[int, ...]:
    """Pieces of one layer of each group: its heads over the piece's, times its width over the piece's."""
    heads, dims = kv_piece_shape(groups, default)
    return tuple((h // heads) * (d // dims) for h, d in (_shape(spec, default) for spec, _ in groups))


def _shape(spec: LayerSpec, default: tuple[int, int]) -> tuple[int, int]:
    return (spec.kv_heads or default[0], spec.head_dim or default[1])


def recurrent_layers(specs: tuple[LayerSpec, ...]) -> tuple[tuple[int, Recurrent], ...]:
    """(layer, spec) of every recurrent layer."""
    return tuple((layer, spec) for layer, spec in enumerate(specs) if isinstance(spec, Recurrent))


def state_bytes_per_slot(specs: tuple[LayerSpec, ...]) -> int:
    """Bytes of one sequence's fixed-size state in every layer that keeps one (float32; 0: none does)."""
    return sum(4 * spec.num_state_floats for _, spec in recurrent_layers(specs))


def _group_pieces(groups: tuple[tuple[LayerSpec, tuple[int, ...]], ...],
                  default: tuple[int, int]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each group's (layer, piece) pairs, layer by layer."""
    pieces = kv_pieces(groups, default)
    return tuple(tuple((layer, piece) for layer in layers for piece in range(n))
                 for (_, layers), n in zip(groups, pieces))


def pool_block_layers(groups: tuple[tuple[LayerSpec, tuple[int, ...]], ...], default: tuple[int, int] = (1, 1)) -> int:
    """The layers (pieces, where shapes differ) one page of the shared KV pool spans (kv/block_pool.py): the
    gcd of the groups' piece counts."""
    return math.gcd(*(len(pieces) for pieces in _group_pieces(groups, default))) or 1


def block_costs(groups: tuple[tuple[LayerSpec, tuple[int, ...]], ...], default: tuple[int, int] = (1, 1)
                ) -> tuple[int, ...]:
    """The pages one block of each KV group takes: its pieces over `pool_block_layers`."""
    unit = pool_block_layers(groups, default)
    return tuple(len(pieces) // unit for pieces in _group_pieces(groups, default))


def page_groups(specs: tuple[LayerSpec, ...], default: tuple[int, int] = (1, 1)
                ) -> tuple[tuple[LayerSpec, tuple[tuple[int, int], ...]], ...]:
    """Each KV group's (layer, piece) pairs cut into runs of `pool_block_layers`, in group order: a block of
    a group is one page of the shared pool for each run, and a run's pieces find their page in the pool's
    arrays by their place in the run (kv/block_pool.py). ((spec, ((layer, piece), ...)), ...), each run with
    its own page tables. `default`: the model's (kv_heads, head_dim), for layers that do not say theirs."""
    groups = kv_groups(specs)
    unit = pool_block_layers(groups, default)
    return tuple((spec, pieces[i:i + unit]) for (spec, _), pieces in zip(groups, _group_pieces(groups, default))
                 for i in range(0, len(pieces), unit))


def held_places(specs: tuple[LayerSpec, ...], default: tuple[int, int], held: range) -> int:
    """The places of a page (of `pool_block_layers`) that a pipeline stage of layers `held` keeps: its share of
    every page is that over `pool_block_layers` (kv/kv_cache.py keeps no array for the others)."""
    return len({place for _, pieces in page_groups(specs, default) for place, (layer, _) in enumerate(pieces)
                if layer in held})


def peak_blocks(spec: LayerSpec, num_tokens: int, chunk_tokens: int, block_size: int) -> int:
    """The most blocks a sequence of `num_tokens` holds in a group of this kind during a step computing
    `chunk_tokens`: all its blocks with full attention; with a window, what a chunk's queries reach back to."""
    blocks = -(-num_tokens // block_size)
    if isinstance(spec, SlidingWindow):
        return min(blocks, (chunk_tokens + spec.window - 2) // block_size + 2)
    return blocks
