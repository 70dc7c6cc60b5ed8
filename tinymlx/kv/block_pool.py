"""The one block pool every KV group draws from: a budget of `capacity` pool blocks.

A pool block is `block_size` tokens of K and V in as many layers as the KV groups' layer counts have in
common (their gcd: core/layer_specs.py `pool_block_layers`). A block of a group costs its layers' share: in Gemma 3 270M (15 window layers,
3 full) a full-attention block costs 1 pool block and a window block 5. A model whose layers are all of
one kind has one group whose blocks cost 1, so the pool is counted as before.

Layout: each group keeps its own id space over its own per-layer arrays (kv_cache.py), and the pool
only counts what the groups hold. Ids of one space could not serve both: a window group's 15 layers
and a full group's 3 would need arrays for every id in all 18 layers, or a page size that only fits
when every group has the same number of layers (vLLM pads groups to that). Here the arrays grow as a
group's ids are handed out (the lowest free id first), so memory follows the blocks held.

When a group takes a block and the pool is full, the least recently used cached block of any group is
evicted (the groups' prefix caches stamp releases from one clock): a long context in one group can use
what the others cache but no longer need.
"""

from __future__ import annotations

import itertools
from typing import Protocol


class PoolMember(Protocol):
    """What the pool reads of a group (group_blocks.GroupBlocks)."""

    cost: int  # pool blocks one of its blocks takes
    num_taken_blocks: int  # used or cached: not on its free list
    num_cached_blocks: int  # cached and unreferenced: evictable
    has_free_id: bool

    def oldest_release(self) -> int | None: ...  # clock stamp of its least recently used cached block
    def evict_oldest(self) -> None: ...  # its least recently used cached block goes to its free list


class BlockPool:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.members: list[PoolMember] = []
        self.clock = itertools.count().__next__  # release stamps, shared by every group's prefix cache

    def join(self, member: PoolMember) -> None:
        self.members.append(member)

    @property
    def num_taken(self) -> int:
        """Pool blocks that groups hold or cache."""
        return sum(m.cost * m.num_taken_blocks for m in self.members)

    @property
    def num_free(self) -> int:
        return self.capacity - self.num_taken

    @property
    def num_cached(self) -> int:
        """Pool blocks that groups cache with no reference: evictable."""
        return sum(m.cost * m.num_cached_blocks for m in self.members)

    @property
    def num_available(self) -> int:
        """Pool blocks a group can take now: free ones, and cached ones it may evict."""
        return self.num_free + self.num_cached

    def make_room(self, member: PoolMember) -> None:
        """Evict least recently used cached blocks (of any group) until one block of `member` fits and it
        has an id for it. The caller checked that enough blocks are free or cached."""
        while self.num_free < member.cost or not member.has_free_id:
            victim = member if self.num_free >= member.cost else self._least_recently_released()
            victim.evict_oldest()

    def _least_recently_released(self) -> PoolMember:
        stamped = [(stamp, i) for i, m in enumerate(self.members) if (stamp := m.oldest_release()) is not None]
        assert stamped, "the pool is full of blocks in use: the caller should have checked"
        return self.members[min(stamped)[1]]

    def check(self) -> None:
        assert 0 <= self.num_taken <= self.capacity, f"{self.num_taken} pool blocks taken of {self.capacity}"
