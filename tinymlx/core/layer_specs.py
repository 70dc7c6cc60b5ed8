"""The kinds of state a model's layers keep (plain data: models declare them, the KV cache sizes and
pages them, the runner hands each layer what its kind needs)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class FullAttention:
    """K/V of every token, in the paged pool: a query at position p sees keys 0..p."""


@dataclass(frozen=True)
class SlidingWindow:
    """K/V of the last `window` tokens: a query at position p sees keys p-window+1..p (transformers'
    convention: key k is visible when k > p - window)."""

    window: int


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


LayerSpec = FullAttention | SlidingWindow | Recurrent


def kv_groups(specs: tuple[LayerSpec, ...]) -> tuple[tuple[LayerSpec, tuple[int, ...]], ...]:
    """Layers of one kind of K/V (full, each window) form a group, in order of first appearance:
    ((spec, layers), ...). Recurrent layers keep no K/V: they are no KV group (see `recurrent_layers`)."""
    groups: dict[LayerSpec, list[int]] = {}
    for layer, spec in enumerate(specs):
        if not isinstance(spec, Recurrent):
            groups.setdefault(spec, []).append(layer)
    return tuple((spec, tuple(layers)) for spec, layers in groups.items())


def recurrent_layers(specs: tuple[LayerSpec, ...]) -> tuple[tuple[int, Recurrent], ...]:
    """(layer, spec) of every recurrent layer."""
    return tuple((layer, spec) for layer, spec in enumerate(specs) if isinstance(spec, Recurrent))


def pool_block_layers(groups: tuple[tuple[LayerSpec, tuple[int, ...]], ...]) -> int:
    """The layers one block of the shared KV pool spans (kv/block_pool.py): the gcd of the groups' layer counts."""
    return math.gcd(*(len(layers) for _, layers in groups)) or 1


def block_costs(groups: tuple[tuple[LayerSpec, tuple[int, ...]], ...]) -> tuple[int, ...]:
    """The pages one block of each KV group takes: its layers over `pool_block_layers`."""
    unit = pool_block_layers(groups)
    return tuple(len(layers) // unit for _, layers in groups)


def page_groups(specs: tuple[LayerSpec, ...]) -> tuple[tuple[LayerSpec, tuple[int, ...]], ...]:
    """Each KV group's layers cut into runs of `pool_block_layers`, in group order: a block of a group is one
    page of the shared pool for each run, and a run's layers find their page in the pool's arrays by their
    place in the run (kv/block_pool.py). ((spec, layers), ...), each run with its own page tables."""
    groups = kv_groups(specs)
    unit = pool_block_layers(groups)
    return tuple((spec, layers[i:i + unit]) for spec, layers in groups for i in range(0, len(layers), unit))


def peak_blocks(spec: LayerSpec, num_tokens: int, chunk_tokens: int, block_size: int) -> int:
    """The most blocks a sequence of `num_tokens` holds in a group of this kind during a step computing
    `chunk_tokens`: all its blocks with full attention; with a window, what a chunk's queries reach back to."""
    blocks = -(-num_tokens // block_size)
    if isinstance(spec, SlidingWindow):
        return min(blocks, (chunk_tokens + spec.window - 2) // block_size + 2)
    return blocks
