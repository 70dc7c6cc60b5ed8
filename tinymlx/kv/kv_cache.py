"""The paged KV pool: slot writes and block-table reads.

Each layer owns one K and one V pool of `num_blocks * block_size` slots per KV head:

    pool[layer]:  | block 0 ......... | block 1 ......... | ... | block n-1 ....... |
                    slot 0 .. bs-1      slot bs .. 2bs-1
    block_table (per sequence) = [7, 2, 9]  ->  token at position p lives in
                    slot = block_table[p // bs] * bs + p % bs

A step first scatters its new K/V into their slots (`slot_mapping`), then every sequence
gathers its context back through its block table and attends over it. Layers of one kind of state
(full attention, a sliding window of W) form a KV group with its own block ids and tables; a
sliding group's sequences gather only the blocks their window reaches, and its mask hides the keys
older than the window. With kv_cache_dtype="int8" each K and V pool is three arrays (codes, scales,
biases: kv_layout.py), quantized as the step writes them and read as they are.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from tinymlx.core.kv_layout import KV_BITS, KVLayout
from tinymlx.kv.state_cache import RecurrentStep
from tinymlx.ops import kernels
from tinymlx.ops.attention import KV, QuantizedKV


class AttentionGroup(NamedTuple):
    """Sequences whose queries are padded to one shape [B, L] (decodes: L = 1)."""

    token_index: mx.array  # [B, L] index of each query in the flat batch (padding repeats a real one)
    visible: tuple[mx.array, ...]  # per KV group: [B, L, context] True where a query may see a slot
    block_tables: tuple[mx.array, ...]  # per KV group: [B, blocks read] (padding: block 0, masked out)
    unpad_index: mx.array | None  # [n] rows of the flattened [B*L] output that are real tokens


class PagedAttentionMetadata(NamedTuple):
    """Everything attention needs for one step; built by the model runner, read by every layer."""

    slot_mapping: mx.array  # [kv_groups, N] pool slot of each new token's K/V, in each KV group's pool
    groups: tuple[AttentionGroup, ...]  # flat batch order = groups in order, real tokens row-major
    kv_group_of_layer: tuple[int, ...]  # each layer's KV group: its slots, tables and mask


def _zeros(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """mx.zeros through NumPy's zero pages: on the CPU, with the weights loaded, mx.zeros filled the
    default model's 1.5 GiB pool in 5.6 s, this in 1.0 s. All-zero bits are 0.0 in every float dtype.
    (Zeros, not garbage: a masked slot's V is multiplied by a zero weight, and garbage could be NaN.)"""
    return mx.array(np.zeros(shape, dtype=f"u{dtype.size}")).view(dtype)


_MIN_SLAB_BLOCKS = 16
_SLABS_PER_BUDGET = 16


class PagedKVCache:
    """`num_blocks_of_layer`: each layer's pool budget, its KV group's. `layout`: what a token's K/V is
    stored as (kv_layout.py): one pool array per layer for K and one for V, or with int8 three of each
    (packed codes, scales, biases), all [kv_heads, slots, width].

    The arrays start at one slab (1/16 of the budget) and double, up to the budget, when a step
    reaches a block past them (`ensure_group_blocks`): memory follows the blocks held, not the budget. The
    block manager hands out the lowest free ids, so the ids in use stay below what is held at once.
    `shrink` gives back the tail no block reaches. `budget_nbytes`: the whole pool's bytes (the KV groups
    share it: kv/block_pool.py); a group's doubling stops where it would take the arrays past it."""

    def __init__(self, num_blocks_of_layer: tuple[int, ...], block_size: int, num_kv_heads: int, layout: KVLayout,
                 budget_nbytes: int | None = None):
        self.num_blocks_of_layer, self.block_size, self.layout = num_blocks_of_layer, block_size, layout
        self.budget_nbytes = budget_nbytes
        self.num_kv_heads = num_kv_heads
        self.num_allocated_blocks = [self._slab(budget) for budget in num_blocks_of_layer]
        # KV heads lead, so a gather through block tables lands as [kv_heads, B, context, width]:
        # contiguous matrices per (head, sequence) that BLAS multiplies without a transposing copy.
        self.pools = [self._new_arrays(num_blocks) for num_blocks in self.num_allocated_blocks]
        mx.eval(self.pools)

    @staticmethod
    def _slab(budget: int) -> int:
        return min(budget, max(_MIN_SLAB_BLOCKS, -(-budget // _SLABS_PER_BUDGET)))

    def _new_arrays(self, num_blocks: int) -> tuple[mx.array, ...]:
        return tuple(_zeros((self.num_kv_heads, num_blocks * self.block_size, width), dtype)
                     for _ in ("keys", "values") for width, dtype in self.layout.widths)

    def ensure_blocks(self, layer: int, num_blocks: int) -> None:
        """Grow the layer's arrays (doubling, up to its budget) to hold block ids below `num_blocks`."""
        allocated, budget = self.num_allocated_blocks[layer], self.num_blocks_of_layer[layer]
        if num_blocks <= allocated:
            return
        assert num_blocks <= budget, f"block {num_blocks - 1} is past layer {layer}'s budget of {budget}"
        target = allocated
        while target < num_blocks:
            target = min(budget, 2 * target)
        self._resize(layer, target)

    def ensure_group_blocks(self, layers: tuple[int, ...], num_blocks: int) -> None:
        """Grow one KV group's layers' arrays to hold block ids below `num_blocks`: doubling, but not past what
        the pool's byte budget leaves beside the other groups' arrays, unless the blocks needed (rounded up
        to a slab) are past that too."""
        allocated, budget = self.num_allocated_blocks[layers[0]], self.num_blocks_of_layer[layers[0]]
        if num_blocks <= allocated:
            return
        assert num_blocks <= budget, f"block {num_blocks - 1} is past layers {layers}' budget of {budget}"
        target = allocated
        while target < num_blocks:
            target = min(budget, 2 * target)
        if self.budget_nbytes is not None:
            others = self.nbytes - sum(self.layer_nbytes(layer) for layer in layers)
            affordable = (self.budget_nbytes - others) // (len(layers) * self.block_nbytes)
            slab = self._slab(budget)
            target = min(target, max(affordable, -(-num_blocks // slab) * slab))
        for layer in layers:
            if target > self.num_allocated_blocks[layer]:
                self._resize(layer, target)

    def shrink(self, layer: int, num_blocks: int) -> None:
        """Give back the layer's blocks from `num_blocks` on (rounded up to the slab doubling): no id there is held."""
        target = self._slab(self.num_blocks_of_layer[layer])
        while target < num_blocks:
            target = min(self.num_blocks_of_layer[layer], 2 * target)
        if target < self.num_allocated_blocks[layer]:
            self._resize(layer, target)

    def _resize(self, layer: int, num_blocks: int) -> None:
        # New buffers, one layer at a time: the peak is the pool plus one layer's new arrays.
        slots, arrays = num_blocks * self.block_size, []
        for old, (width, dtype) in zip(self.pools[layer], self.layout.widths * 2):
            if slots > old.shape[1]:
                new = mx.concatenate([old, _zeros((self.num_kv_heads, slots - old.shape[1], width), dtype)], axis=1)
            else:
                new = mx.contiguous(old[:, :slots])
            mx.eval(new)
            arrays.append(new)
        self.pools[layer] = tuple(arrays)
        self.num_allocated_blocks[layer] = num_blocks

    def release(self) -> None:
        """Give every array back (the engine is closing): nothing is allocated, and nothing can be written."""
        self.pools = [() for _ in self.pools]
        self.num_allocated_blocks = [0 for _ in self.num_allocated_blocks]

    @property
    def arrays(self) -> list[mx.array]:
        """Every pool array (a step writes them in place)."""
        return [array for pool in self.pools for array in pool]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def layer_nbytes(self, layer: int) -> int:
        return sum(a.nbytes for a in self.pools[layer])

    @property
    def block_nbytes(self) -> int:
        """Bytes one block takes in one layer (K and V, every KV head)."""
        return self.num_kv_heads * self.block_size * self.layout.bytes_per_token_head

    def write(self, layer: int, k: mx.array, v: mx.array, slot_mapping: mx.array) -> None:
        """Store new K/V [N, kv_heads, head_dim] in their slots (int8: quantized on the way). In place:
        each pool array has one owner, so MLX's scatter reuses its buffer."""
        for pool, new in zip(self.pools[layer], (*self._encode(k), *self._encode(v))):
            pool[:, slot_mapping] = new.swapaxes(0, 1)

    def _encode(self, x: mx.array) -> tuple[mx.array, ...]:
        if not self.layout.is_quantized:
            return (x,)
        return tuple(mx.quantize(x, group_size=self.layout.group_size, bits=KV_BITS))

    def gather(self, layer: int, block_tables: mx.array) -> tuple[KV, KV]:
        """K and V of each sequence's context, [kv_heads, B, max_blocks * block_size, ...]."""
        B, num_table_blocks = block_tables.shape

        def read(pool: mx.array) -> mx.array:
            kv_heads, _, width = pool.shape
            blocks = pool.reshape(kv_heads, self.num_allocated_blocks[layer], self.block_size, width)[:, block_tables]
            return blocks.reshape(kv_heads, B, num_table_blocks * self.block_size, width)

        arrays = [read(pool) for pool in self.pools[layer]]
        if not self.layout.is_quantized:
            return arrays[0], arrays[1]
        group_size = self.layout.group_size
        return QuantizedKV(*arrays[:3], group_size), QuantizedKV(*arrays[3:], group_size)

    # -- whole blocks, as host arrays (the prefix cache's disk tier) ---------------------------------
    def read_blocks(self, layer: int, block_ids: list[int]) -> list[np.ndarray]:
        """The layer's pool arrays at `block_ids`, each [kv_heads, len(block_ids) * block_size, width]."""
        slots = self._block_slots(block_ids)
        arrays = [pool[:, slots] for pool in self.pools[layer]]
        mx.eval(arrays)
        return [np.array(a.view(mx.uint16)).view(np.uint16) if a.dtype == mx.bfloat16 else np.array(a)
                for a in arrays]

    def write_blocks(self, layer: int, block_ids: list[int], arrays: list[np.ndarray]) -> None:
        """Store arrays read by `read_blocks` (of the same layout) into `block_ids`."""
        self.ensure_blocks(layer, max(block_ids) + 1)
        slots = self._block_slots(block_ids)
        for pool, array in zip(self.pools[layer], arrays):
            value = mx.array(array)
            pool[:, slots] = value.view(mx.bfloat16) if pool.dtype == mx.bfloat16 else value

    def _block_slots(self, block_ids: list[int]) -> mx.array:
        first = np.asarray(block_ids, dtype=np.int32)[:, None] * self.block_size
        return mx.array((first + np.arange(self.block_size, dtype=np.int32)).reshape(-1))


class PagedAttention:
    """Attention backend over the paged pool for one step (see `AttentionBackend`); recurrent layers'
    calls go to the step's `recurrent` half (state_cache.RecurrentStep)."""

    def __init__(self, cache: PagedKVCache, metadata: PagedAttentionMetadata, recurrent: RecurrentStep | None = None):
        self.cache, self.metadata = cache, metadata
        if recurrent is not None:
            self.conv1d, self.delta_rule = recurrent.conv1d, recurrent.delta_rule

    def __call__(self, layer: int, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        kv_group = self.metadata.kv_group_of_layer[layer]
        self.cache.write(layer, k, v, self.metadata.slot_mapping[kv_group])
        outputs = []
        for group in self.metadata.groups:  # decodes, then prefill tiles, each grouped by reach
            keys, values = self.cache.gather(layer, group.block_tables[kv_group])
            out = kernels.attention(q[group.token_index], keys, values, group.visible[kv_group], scale)
            out = out.reshape(-1, *out.shape[2:])
            outputs.append(out if group.unpad_index is None else out[group.unpad_index])
        return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)
