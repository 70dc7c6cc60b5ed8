"""The paged KV pool: slot writes and block-table reads.

Each place of a run of layers (block_pool.py) owns one K and one V array of `num_pages * block_size`
slots per KV head, shared by the layers at that place:

    pool[place]:  | page 0 .......... | page 1 .......... | ... | page n-1 ........ |
                    slot 0 .. bs-1      slot bs .. 2bs-1
    page_table (per sequence and run) = [7, 2, 9]  ->  token at position p lives in
                    slot = page_table[p // bs] * bs + p % bs

A step first scatters its new K/V into their slots (`slot_mapping`), then every sequence
gathers its context back through its page table and attends over it. Layers of one kind of state
(full attention, a sliding window of W) form a KV group; each run of its layers has its own page tables
(a page group: core/layer_specs.py `page_groups`). A sliding group's sequences gather only the blocks their window reaches, and its mask hides the keys
older than the window. With kv_cache_dtype="int8" each K and V pool is three arrays (codes, scales,
biases: kv_layout.py), quantized as the step writes them and read as they are.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np

from tinymlx.core.kv_layout import KV_BITS, KVLayout
from tinymlx.core.layer_specs import LayerSpec, kv_source, page_groups
from tinymlx.kv.padded_pieces import unpadded
from tinymlx.kv.state_pool import StateStep
from tinymlx.kv.zero_pages import zeros
from tinymlx.ops import kernels
from tinymlx.ops.attention import KV, QuantizedKV


class AttentionGroup(NamedTuple):
    """Sequences whose queries are padded to one shape [B, L] (decodes: L = 1)."""

    token_index: mx.array  # [B, L] index of each query in the flat batch (padding repeats a real one)
    visible: tuple[mx.array, ...]  # per page group: [B, L, context] True where a query may see a slot
    block_tables: tuple[mx.array, ...]  # per page group: [B, pages read] (padding: page 0, masked out)
    unpad_index: mx.array | None  # [n] rows of the flattened [B*L] output that are real tokens


class PagedAttentionMetadata(NamedTuple):
    """Everything attention needs for one step; built by the model runner, read by every layer."""

    slot_mapping: mx.array  # [page_groups, N] pool slot of each new token's K/V, through each page group's pages
    groups: tuple[AttentionGroup, ...]  # flat batch order = groups in order, real tokens row-major


class LayerPieces(NamedTuple):
    """Where one layer's K/V live: a piece per (page group, place) (core/layer_specs.py: one piece, unless
    the model's layers differ in K/V shape), `columns` pieces across its head_dim, the rest down its heads.
    A shared-KV layer has its source's: it reads them and writes none."""

    page_groups: tuple[int, ...]  # each piece's page group: its slots, tables and mask
    places: tuple[int, ...]  # each piece's place in its run: which pool arrays
    columns: int = 1


def pieces_of_layers(specs: tuple[LayerSpec, ...], model_shape: tuple[int, int],
                     piece_dim: int) -> tuple[LayerPieces | None, ...]:
    """Each layer's pieces: its own, a shared-KV layer's source's, or None for a layer that keeps no K/V.
    `model_shape`: the model's (kv_heads, head_dim); `piece_dim`: a piece's width (core/config.py)."""
    where = {piece: (g, place) for g, (_, pieces) in enumerate(page_groups(specs, model_shape))
             for place, piece in enumerate(pieces)}
    own: dict[int, LayerPieces] = {}
    for layer, piece in sorted(where):
        g, place = where[layer, piece]
        previous = own.get(layer, LayerPieces((), (), (specs[layer].head_dim or model_shape[1]) // piece_dim))
        own[layer] = previous._replace(page_groups=(*previous.page_groups, g), places=(*previous.places, place))
    return tuple(own.get(kv_source(specs, layer)) for layer in range(len(specs)))


_MIN_SLAB_BLOCKS = 16
_SLABS_PER_BUDGET = 16


class PagedKVCache:
    """The shared pool's arrays (block_pool.py): `num_pages` pages of `block_size` tokens, in each of
    `num_places` places of a run of layers. `pieces_of_layer`: each layer's pieces (`pieces_of_layers`; None:
    a layer that keeps no K/V); the layers at one place, one from each run of every KV group, share its arrays,
    each writing and reading the pages its own page tables name. `layout`: what a token's K/V is stored as (kv_layout.py),
    `num_kv_heads` of a piece's heads: one array per place for K and one for V, or with int8 three of each
    (packed codes, scales, biases), all [kv_heads, slots, width].

    The arrays start at one slab (1/16 of the pages) and double, up to all pages, when a step reaches a
    page past them (`ensure_pages`): memory follows the pages held, not the budget, as the pool hands out
    the lowest free pages. `shrink` gives back the tail no page reaches."""

    def __init__(self, pieces_of_layer: tuple[LayerPieces | None, ...], num_pages: int, block_size: int,
                 num_kv_heads: int, layout: KVLayout):
        self.pieces_of_layer, self.num_pages, self.block_size, self.layout = pieces_of_layer, num_pages, block_size, layout
        self.num_kv_heads = num_kv_heads
        # A pipeline stage holds the places of its own layers only (the others' pieces are None here).
        held = {place for pieces in pieces_of_layer if pieces for place in pieces.places}
        self.num_held_places = len(held)
        self.num_allocated_pages = self._slab()
        # KV heads lead, so a gather through block tables lands as [kv_heads, B, context, width]:
        # contiguous matrices per (head, sequence) that BLAS multiplies without a transposing copy.
        self.pools = [self._new_arrays(self.num_allocated_pages) if place in held else ()
                      for place in range(max(held, default=-1) + 1)]
        mx.eval(self.pools)

    def _slab(self) -> int:
        return min(self.num_pages, max(_MIN_SLAB_BLOCKS, -(-self.num_pages // _SLABS_PER_BUDGET)))

    def _new_arrays(self, num_pages: int) -> tuple[mx.array, ...]:
        return tuple(zeros((self.num_kv_heads, num_pages * self.block_size, width), dtype)
                     for _ in ("keys", "values") for width, dtype in self.layout.widths)

    def ensure_pages(self, num_pages: int, limit: int | None = None) -> None:
        """Grow the arrays (doubling, up to `limit` pages: all by default) to hold the pages below `num_pages`;
        first give back those from `limit` on (the state slots' region took them: kv/block_pool.py)."""
        limit = self.num_pages if limit is None else limit
        assert num_pages <= limit <= self.num_pages, f"page {num_pages - 1} is past the pool's {limit}"
        if self.num_allocated_pages > limit:
            self._resize(limit)
        if num_pages <= self.num_allocated_pages:
            return
        target = max(self.num_allocated_pages, 1)
        while target < num_pages:
            target = min(limit, 2 * target)
        self._resize(target)

    def shrink(self, num_pages: int) -> None:
        """Give back the pages from `num_pages` on (rounded up to the slab doubling): no page there is taken."""
        target = self._slab()
        while target < num_pages:
            target = min(self.num_pages, 2 * target)
        if target < self.num_allocated_pages:
            self._resize(target)

    def _resize(self, num_pages: int) -> None:
        # New buffers, one place at a time: the peak is the pool plus one place's new arrays.
        slots = num_pages * self.block_size
        for place, pool in enumerate(self.pools):
            arrays = []
            for old, (width, dtype) in zip(pool, self.layout.widths * 2):
                if slots > old.shape[1]:
                    new = mx.concatenate([old, zeros((self.num_kv_heads, slots - old.shape[1], width), dtype)], axis=1)
                else:
                    new = mx.contiguous(old[:, :slots])
                mx.eval(new)
                arrays.append(new)
            self.pools[place] = tuple(arrays)
        self.num_allocated_pages = num_pages

    def release(self) -> None:
        """Give every array back (the engine is closing): nothing is allocated, and nothing can be written."""
        self.pools = [() for _ in self.pools]
        self.num_allocated_pages = 0

    @property
    def arrays(self) -> list[mx.array]:
        """Every pool array (a step writes them in place)."""
        return [array for pool in self.pools for array in pool]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    @property
    def block_nbytes(self) -> int:
        """Bytes one block takes in one layer (K and V, every KV head)."""
        return self.num_kv_heads * self.block_size * self.layout.bytes_per_token_head

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page: a block in every place held."""
        return self.num_held_places * self.block_nbytes

    def write(self, layer: int, k: mx.array, v: mx.array, slot_mapping: mx.array) -> None:
        """Store new K/V [N, kv_heads, head_dim] in their slots (int8: quantized on the way), piece by piece
        through each piece's page group (`slot_mapping` [page_groups, N]). In place: each pool array has one
        owner, so MLX's scatter reuses its buffer (the layers sharing a place write it one after another, each
        after the one before has read it)."""
        pieces = self.pieces_of_layer[layer]
        for g, place, k_piece, v_piece in zip(pieces.page_groups, pieces.places, self._split(k, pieces.columns),
                                              self._split(v, pieces.columns)):
            for pool, new in zip(self.pools[place], (*self._encode(k_piece), *self._encode(v_piece))):
                pool[:, slot_mapping[g]] = new.swapaxes(0, 1)

    def _split(self, x: mx.array, columns: int) -> list[mx.array]:
        """[N, kv_heads, head_dim] -> its pieces [N, piece heads, piece width], heads-major."""
        if x.shape[1:] == (self.num_kv_heads, self.layout.head_dim):
            return [x]
        h, d = self.num_kv_heads, self.layout.head_dim
        return [x[:, i:i + h, j * d:(j + 1) * d] for i in range(0, x.shape[1], h) for j in range(columns)]

    def _encode(self, x: mx.array) -> tuple[mx.array, ...]:
        if not self.layout.is_quantized:
            return (x,)
        return tuple(mx.quantize(x, group_size=self.layout.group_size, bits=KV_BITS))

    def gather(self, layer: int, block_tables: tuple[mx.array, ...]) -> tuple[KV, KV]:
        """K and V of each sequence's context, [kv_heads, B, max_blocks * block_size, ...], through each
        piece's page group's `block_tables` [B, pages read] (a layer of several pieces: joined, a copy)."""
        pieces = self.pieces_of_layer[layer]
        parts = [self._gather_place(place, block_tables[g]) for g, place in zip(pieces.page_groups, pieces.places)]
        if len(parts) == 1:
            return parts[0]
        return _join([k for k, _ in parts], pieces.columns), _join([v for _, v in parts], pieces.columns)

    def _gather_place(self, place: int, block_tables: mx.array) -> tuple[KV, KV]:
        B, num_table_blocks = block_tables.shape

        def read(pool: mx.array) -> mx.array:
            kv_heads, _, width = pool.shape
            blocks = pool.reshape(kv_heads, self.num_allocated_pages, self.block_size, width)[:, block_tables]
            return blocks.reshape(kv_heads, B, num_table_blocks * self.block_size, width)

        arrays = [read(pool) for pool in self.pools[place]]
        if not self.layout.is_quantized:
            return arrays[0], arrays[1]
        group_size = self.layout.group_size
        return QuantizedKV(*arrays[:3], group_size), QuantizedKV(*arrays[3:], group_size)

    # -- whole blocks, as host arrays (the prefix cache's disk tier) ---------------------------------
    def read_blocks(self, place: int, pages: list[int]) -> list[np.ndarray]:
        """The arrays of `place` (one layer's piece, in the run whose page tables name `pages`) at `pages`,
        each [kv_heads, len(pages) * block_size, width]."""
        slots = self._block_slots(pages)
        arrays = [pool[:, slots] for pool in self.pools[place]]
        mx.eval(arrays)
        return [np.array(a.view(mx.uint16)).view(np.uint16) if a.dtype == mx.bfloat16 else np.array(a)
                for a in arrays]

    def write_blocks(self, place: int, pages: list[int], arrays: list[np.ndarray]) -> None:
        """Store arrays read by `read_blocks` (of the same layout) into `pages` of `place`."""
        self.ensure_pages(max(pages) + 1)
        slots = self._block_slots(pages)
        for pool, array in zip(self.pools[place], arrays):
            value = mx.array(array)
            pool[:, slots] = value.view(mx.bfloat16) if pool.dtype == mx.bfloat16 else value

    def _block_slots(self, pages: list[int]) -> mx.array:
        first = np.asarray(pages, dtype=np.int32)[:, None] * self.block_size
        return mx.array((first + np.arange(self.block_size, dtype=np.int32)).reshape(-1))


class PagedAttention:
    """Attention backend over the paged pool for one step (see `AttentionBackend`); the other calls layers
    make (a recurrent layer's conv1d, delta_rule) go to the step of the state pool that provides them
    (kv/state_pool.py)."""

    def __init__(self, cache: PagedKVCache, metadata: PagedAttentionMetadata, states: tuple[StateStep, ...] = ()):
        self.cache, self.metadata = cache, metadata
        for state in states:
            for name, call in state.backend_calls.items():
                setattr(self, name, call)

    def __call__(self, layer: int, q: mx.array, k: mx.array | None, v: mx.array | None, scale: float,
                 sinks: mx.array | None = None) -> mx.array:
        """k, v None: a shared-KV layer, which reads the pieces of its source (its LayerPieces) and writes none."""
        pieces = self.cache.pieces_of_layer[layer]
        if k is not None:
            self.cache.write(layer, k, v, self.metadata.slot_mapping)
        outputs = []
        for group in self.metadata.groups:  # decodes, then prefill tiles, each grouped by reach
            keys, values = self.cache.gather(layer, group.block_tables)
            out = kernels.attention(q[group.token_index], keys, values, group.visible[pieces.page_groups[0]], scale,
                                    sinks)
            outputs.append(unpadded(out, group.unpad_index))
        return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)


def _join(parts: list[KV], columns: int) -> KV:
    """A layer's pieces [piece heads, B, T, piece width] -> [kv_heads, B, T, head_dim]: `columns` across,
    the rest down."""
    if isinstance(parts[0], QuantizedKV):
        fields = [_join([part[i] for part in parts], columns) for i in range(3)]
        return QuantizedKV(*fields, parts[0].group_size)
    rows = [mx.concatenate(parts[i:i + columns], axis=-1) if columns > 1 else parts[i]
            for i in range(0, len(parts), columns)]
    return rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=0)
