"""The one block pool every KV group draws from: `capacity` pages, with one free list.

A page is `block_size` tokens of K and V in as many layers as the KV groups' layer counts have in common
(their gcd: core/layer_specs.py `pool_block_layers`). The pool's arrays hold that many layers' worth,
one set per place in a run of layers (kv_cache.py), and every page is the same size. A block of a group
takes one page for each run of that many of its layers: in Gemma 3 270M (15 window layers, 3 full) a
full-attention block is 1 page, a window block 5 (`block_costs`). A model whose layers are all of one
kind has one group whose blocks are one page each: the pool counts as before.

This is vLLM's hybrid layout (a page size common to all groups), kept apart from the groups' own ids: a
group keeps its block ids, tables, prefix cache and window release, and asks the pool for pages when it
takes a block. One free list of pages, the lowest first, keeps the pages in use compact, so the arrays,
which grow as pages are handed out, hold what the blocks held and cached take and never more than the
pool's bytes. Per-group arrays over per-group ids would not: a group's cached blocks scatter its ids,
and its arrays follow the highest.

When a group takes a block and the pool has too few free pages, the least recently used cached block of
any group is evicted (the groups' prefix caches stamp releases from one clock): a long context in one
group uses what the others cache but no longer need.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Protocol


class PoolMember(Protocol):
    """What the pool reads of a group (group_blocks.GroupBlocks)."""

    cost: int  # pages one of its blocks takes
    num_cached_blocks: int  # cached and unreferenced: evictable
    has_free_id: bool

    def oldest_release(self) -> int | None: ...  # clock stamp of its least recently used cached block
    def evict_oldest(self) -> None: ...  # its least recently used cached block's pages go back to the pool


class BlockPool:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free = list(range(capacity))  # a heap (sorted is one): the lowest page goes first
        self.members: list[PoolMember] = []
        self.clock = itertools.count().__next__  # release stamps, shared by every group's prefix cache

    def join(self, member: PoolMember) -> None:
        self.members.append(member)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_taken(self) -> int:
        """Pages of blocks that groups hold or cache."""
        return self.capacity - len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages of cached blocks no sequence references: evictable."""
        return sum(m.cost * m.num_cached_blocks for m in self.members)

    @property
    def num_available(self) -> int:
        """Pages a group can take now: free ones, and those of cached blocks it may evict."""
        return self.num_free + self.num_cached

    @property
    def num_pages_reached(self) -> int:
        """One past the highest page taken: the arrays must keep at least these pages."""
        free = set(self._free)
        return next((page + 1 for page in range(self.capacity - 1, -1, -1) if page not in free), 0)

    def take(self, member: PoolMember) -> tuple[int, ...]:
        """The pages of a new block of `member`, evicting least recently used cached blocks (of any group)
        until they are free and `member` has an id for the block. The caller checked that enough pages are
        free or cached."""
        while self.num_free < member.cost or not member.has_free_id:
            victim = member if self.num_free >= member.cost else self._least_recently_released()
            victim.evict_oldest()
        return tuple(heapq.heappop(self._free) for _ in range(member.cost))

    def give(self, pages: tuple[int, ...]) -> None:
        for page in pages:
            heapq.heappush(self._free, page)

    def _least_recently_released(self) -> PoolMember:
        stamped = [(stamp, i) for i, m in enumerate(self.members) if (stamp := m.oldest_release()) is not None]
        assert stamped, "the pool is full of blocks in use: the caller should have checked"
        return self.members[min(stamped)[1]]

    def check(self, pages_held: list[tuple[int, ...]]) -> None:
        """`pages_held`: the pages of every block the groups hold or cache."""
        held = [page for pages in pages_held for page in pages]
        assert len(set(held)) == len(held), "a page belongs to two blocks"
        assert len(set(self._free)) == len(self._free), "a page is on the free list twice"
        assert not set(held) & set(self._free), "a held page is on the free list"
        assert len(held) + len(self._free) == self.capacity, f"{len(held)} pages held + {len(self._free)} free"
