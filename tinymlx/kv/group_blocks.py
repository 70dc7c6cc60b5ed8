"""The attention kinds' managers (kv/layer_state.py): one KV group's blocks, its ids, free list, refcounts
and prefix cache (GroupBlocks: full attention), and a sliding window's release (SlidingWindowBlocks).
Each block it holds or caches owns `cost` pages of the shared pool (block_pool.py), one per run of the
group's layers: the page tables the runner reads (KVCoordinator.page_tables).

In each group, every block is in exactly one of three states:
    free       ref 0, no hash         in `_free` (a heap: the lowest id goes first)
    cached     ref 0, hashed or tail  in the group's prefix-cache LRU (reusable, evictable)
    used       ref > 0                in one or more block tables (hashed or not)
Full blocks are shared read-only between sequences with the same prefix; a sequence only ever
writes to its own partial last block, so sharing needs no copy-on-write. A freed sequence's partial last
block is cached as a tail, which one later sequence may take over whole (prefix_cache.py).

A sliding group holds only the blocks its window still reaches: those wholly before it are released
(their table entries become NULL_BLOCK) once the sequence has moved past, so a sequence holds at most
ceil(W / bs) + 1 blocks there between steps, plus the blocks of the chunk it computes during one. Its
blocks are allocated chunk by chunk, not for the whole prompt at admission.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import NamedTuple

from tinymlx.core.layer_specs import FullAttention, SlidingWindow, peak_blocks
from tinymlx.kv.block_pool import BlockPool
from tinymlx.kv.layer_state import BlockHashes, LayerStateManager, ResumeQuery
from tinymlx.kv.prefix_cache import PrefixCache
from tinymlx.ops.attention import first_visible_key

NULL_BLOCK = -1  # a sliding group's table entry for a block that fell out of the window


class GroupAdmission(NamedTuple):
    """What admitting a sequence takes in one group (`GroupBlocks.plan`), before anything is taken."""

    first: int  # the first block the sequence reads (a window's: the ones before it are NULL_BLOCK)
    hits: list[int | None]  # cached blocks first..depth-1 (None: no longer cached, a new block restores it)
    num_new: int  # new blocks after the hits (the tail's place included)
    tail: int | None  # a cached tail taken over as block `depth`
    num_revived: int  # hits that were evictable: referencing them leaves fewer blocks to evict


class GroupBlocks(LayerStateManager):
    """One full-attention KV group's blocks; `cost`: the pages one of its blocks takes. Its ids run to the
    most it could ever hold alone."""

    window: int | None = None  # the tokens a query reaches back (None: all)

    def __init__(self, pool: BlockPool, cost: int, block_size: int, enable_prefix_caching: bool = True):
        self.pool, self.cost = pool, cost
        self.num_blocks, self.block_size = pool.capacity // cost, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * self.num_blocks
        self._free: list[int] = list(range(self.num_blocks))  # a heap (sorted is one)
        self.pages: list[tuple[int, ...] | None] = [None] * self.num_blocks  # each held or cached block's pages
        self._block_of_page: dict[int, int] = {}
        self.prefix_cache = PrefixCache(pool.clock)
        pool.join(self)

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks of this group it could take now: from the free pages and those it may evict, in any group."""
        return self.pool.num_available // self.cost

    @property
    def num_cached_blocks(self) -> int:
        return self.prefix_cache.num_evictable

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - self.num_cached_blocks

    @property
    def has_free_id(self) -> bool:
        return bool(self._free)

    def oldest_release(self) -> int | None:
        return self.prefix_cache.oldest_release

    def evict_oldest(self) -> None:
        """Forget the least recently used cached block; its pages go back to the pool (the pool's call)."""
        self._to_free(self.prefix_cache.evict_oldest())

    def release_stamp(self, page: int) -> int | None:
        return self.prefix_cache.release_stamp(self._block_of_page[page])

    def evict_holding(self, page: int) -> None:
        """Forget the cached block holding `page` (the pool's call, as the state slots' region grows)."""
        self._to_free(self.prefix_cache.evict(self._block_of_page[page]))

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_needed_block(self, position: int) -> int:
        """The first block a query at `position` (or later) may read: a window reaches back W - 1 tokens."""
        return first_visible_key(position, self.window) // self.block_size

    @property
    def spec(self) -> FullAttention | SlidingWindow:
        return FullAttention()

    @property
    def max_blocks_between_steps(self) -> int | None:
        """What a sequence holds here at most between steps (None: its whole context)."""
        return None

    def peak_blocks(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most blocks a sequence of `num_tokens` holds here during a step computing `chunk_tokens`."""
        return peak_blocks(self.spec, num_tokens, chunk_tokens, self.block_size)

    def held(self, table: list[int]) -> int:
        return sum(block_id != NULL_BLOCK for block_id in table)

    # -- prefix hits --------------------------------------------------------------------------
    def resume_query(self, hashes: BlockHashes) -> ResumeQuery:
        return _ChainQuery(self, hashes)

    def has_block(self, hashes: BlockHashes, index: int, restorable: Callable[[int], bool]) -> bool:
        """Whether block `index` is cached here, or `restorable` (the disk tier holds it)."""
        return self.prefix_cache.lookup(*hashes[index]) is not None or restorable(index)

    def blocks_to_allocate(self, num_tokens: int, first_chunk_end: int) -> int:
        """Blocks an admitted sequence holds: all its tokens' (the rest come with each chunk where not)."""
        return self.blocks_for(num_tokens)

    def plan(self, hashes: BlockHashes, depth: int, num_tokens: int,
             first_chunk_end: int, tail: int | None = None) -> GroupAdmission:
        """What a sequence resumed at block `depth` takes here: its hits, and new blocks (`blocks_to_allocate`).
        A block before `depth` that this group no longer caches gets a new block too: the caller restores it
        (from the disk tier). `tail`: a cached tail the sequence takes over as block `depth`."""
        first = self.first_needed_block(depth * self.block_size)
        hits = [self.prefix_cache.lookup(*hashes[index]) for index in range(first, depth)]
        num_new = self.blocks_to_allocate(num_tokens, first_chunk_end) - depth
        assert tail is None or (num_new > 0 and self.prefix_cache.is_tail(tail))
        num_revived = sum(self.prefix_cache.is_evictable(block_id) for block_id in hits if block_id is not None)
        return GroupAdmission(first, hits, num_new, tail, num_revived)

    def cost_of(self, admission: GroupAdmission) -> int:
        """Pool blocks the admission takes out of those available: new blocks and revived cached ones."""
        return self.cost * (admission.num_new + admission.hits.count(None) + admission.num_revived)

    def reference(self, admission: GroupAdmission) -> None:
        """Take the admission's hits and tail. Before any group takes new blocks: taking them must not evict a hit."""
        for block_id in admission.hits:
            if block_id is not None:
                self._add_ref(block_id)
        if admission.tail is not None:
            self.prefix_cache.take_tail(admission.tail)
            self.ref_counts[admission.tail] = 1

    def fill(self, admission: GroupAdmission) -> list[int]:
        """The admitted block table: its referenced hits, then new blocks (the caller checked the pool)."""
        table = [NULL_BLOCK] * admission.first
        table += [self._take_block() if block_id is None else block_id for block_id in admission.hits]
        table += [admission.tail] if admission.tail is not None else []
        return table + [self._take_block() for _ in range(admission.num_new - (admission.tail is not None))]

    # -- growth and release -------------------------------------------------------------------
    def blocks_to_cover(self, table: list[int], num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(table))

    def cover(self, table: list[int], num_tokens: int) -> None:
        """Grow `table` to cover `num_tokens` (the caller checked the blocks are there)."""
        for _ in range(self.blocks_to_cover(table, num_tokens)):
            table.append(self._take_block())

    def reserve(self, table: list[int], num_tokens: int, num_extra: int) -> int:
        """Cover up to `num_extra` tokens past `num_tokens` with blocks free now; how many it covers."""
        covered = len(table) * self.block_size - num_tokens
        while covered < num_extra and self.num_free_blocks > 0:
            table.append(self._take_block())
            covered += self.block_size
        return max(0, min(num_extra, covered))

    def trim(self, table: list[int], num_tokens: int, num_computed_tokens: int) -> None:
        """Give back blocks past `num_tokens` (they held rejected drafts, never published) and, in a
        sliding group, the blocks the window no longer reaches from `num_computed_tokens` on."""
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            block_id = table.pop()
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] == 0 and not self.prefix_cache.is_cached(block_id)
            self._to_free(block_id)
        index = min(self.first_needed_block(num_computed_tokens), len(table)) - 1
        while index >= 0 and table[index] != NULL_BLOCK:  # released entries are a prefix of the table
            self._release(table[index])
            table[index] = NULL_BLOCK
            index -= 1

    def publish(self, block_hash: int, tokens: tuple[int, ...], block_id: int) -> None:
        if self.enable_prefix_caching:
            self.prefix_cache.insert(block_hash, tokens, block_id)

    def free(self, table: list[int], tail: tuple[int, int | None, tuple[int, ...]] | None = None) -> None:
        """`tail`: (index, hash of the block before it, tokens it holds K/V for) of the table's partial block
        to keep as a tail: the sequence's computed tokens end inside it."""
        # Release the last block first so a prefix outlives its extensions in the LRU.
        for index in range(len(table) - 1, -1, -1):
            block_id = table[index]
            if block_id == NULL_BLOCK:
                continue
            if tail is not None and index == tail[0] and self.ref_counts[block_id] == 1:
                self.ref_counts[block_id] = 0
                self.prefix_cache.insert_tail(*tail[1:], block_id)
            else:
                self._release(block_id)
        table.clear()

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if self.prefix_cache.is_cached(block_id):
                self.prefix_cache.release(block_id)
            else:
                self._to_free(block_id)

    def _add_ref(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            self.prefix_cache.reclaim(block_id)
        self.ref_counts[block_id] += 1

    def _take_block(self) -> int:
        pages = self.pool.take(self)  # may evict this group's own cached blocks: before an id is taken
        block_id = heapq.heappop(self._free)
        self.ref_counts[block_id], self.pages[block_id] = 1, pages
        self._block_of_page.update(dict.fromkeys(pages, block_id))
        return block_id

    def _to_free(self, block_id: int) -> None:
        self.pool.give(self.pages[block_id])
        for page in self.pages[block_id]:
            del self._block_of_page[page]
        self.pages[block_id] = None
        heapq.heappush(self._free, block_id)

    # -- integrity ----------------------------------------------------------------------------
    def check_blocks(self, tables: Iterable[tuple[int, list[int], int]]) -> list[tuple[int, ...]]:
        """`tables`: (seq_id, this group's table, hashed blocks) of every sequence that may hold blocks. Returns
        the pages of its blocks held or cached, for the pool's check."""
        expected = [0] * self.num_blocks
        bound = self.max_blocks_between_steps
        for seq_id, table, num_hashed in tables:
            held = [block_id for block_id in table if block_id != NULL_BLOCK]
            assert len(set(held)) == len(held), f"seq {seq_id} repeats a block"
            assert num_hashed <= len(table)
            assert bound is None or len(held) <= bound, f"seq {seq_id} holds {len(held)} > {bound} window blocks"
            for block_id in held:
                expected[block_id] += 1
        assert expected == self.ref_counts, "refcounts differ from live block-table references"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block_id in range(self.num_blocks):
            is_free, is_evictable = block_id in free, self.prefix_cache.is_evictable(block_id)
            used = self.ref_counts[block_id] > 0
            assert is_free + is_evictable + used == 1, f"block {block_id} is in {is_free + is_evictable + used} states"
            assert not (is_free and self.prefix_cache.is_cached(block_id)), f"free block {block_id} still hashed"
            assert is_free == (self.pages[block_id] is None), f"block {block_id}'s pages"
            assert is_free or len(self.pages[block_id]) == self.cost, f"block {block_id}'s pages"
            assert is_free or all(self._block_of_page[page] == block_id for page in self.pages[block_id])
        self.prefix_cache.check()
        return [pages for pages in self.pages if pages is not None]


class SlidingWindowBlocks(GroupBlocks):
    """A sliding-window KV group's blocks: only those its window still reaches, allocated chunk by chunk."""

    def __init__(self, pool: BlockPool, cost: int, block_size: int, window: int, enable_prefix_caching: bool = True):
        self.window = window
        super().__init__(pool, cost, block_size, enable_prefix_caching)

    @property
    def spec(self) -> SlidingWindow:
        return SlidingWindow(self.window)

    @property
    def max_blocks_between_steps(self) -> int | None:
        return -(-self.window // self.block_size) + 1

    def resume_query(self, hashes: BlockHashes) -> ResumeQuery:
        return _WindowQuery(self, hashes)

    def blocks_to_allocate(self, num_tokens: int, first_chunk_end: int) -> int:
        return self.blocks_for(first_chunk_end)


def group_blocks(pool: BlockPool, cost: int, block_size: int, window: int | None,
                 enable_prefix_caching: bool = True) -> GroupBlocks:
    """The manager of one KV group: full attention's, or a sliding window's where the group has one."""
    if window is None:
        return GroupBlocks(pool, cost, block_size, enable_prefix_caching)
    return SlidingWindowBlocks(pool, cost, block_size, window, enable_prefix_caching)


class _ChainQuery(ResumeQuery):
    """Full attention resumes after any prefix of the chain it caches (or the lower tier holds)."""

    def __init__(self, group: GroupBlocks, hashes: BlockHashes):
        self.group, self.hashes = group, hashes

    def deepest(self, limit: int, restorable: Callable[[int], bool]) -> int:
        depth = 0
        while depth < limit and self.group.has_block(self.hashes, depth, restorable):
            depth += 1
        return depth


class _WindowQuery(_ChainQuery):
    """A window resumes at any point whose last window it still caches (or the lower tier holds)."""

    def deepest(self, limit: int, restorable: Callable[[int], bool]) -> int:
        return limit

    def can_resume(self, depth: int, restorable: Callable[[int], bool]) -> bool:
        first = self.group.first_needed_block(depth * self.group.block_size)
        return all(self.group.has_block(self.hashes, index, restorable) for index in range(first, depth))
