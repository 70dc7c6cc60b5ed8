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

Recurrent state slots beyond the fixed ones (the checkpoints: kv/state_slots.py) are pages of the pool too,
`slot_cost` pages each, in a region at its top that grows down as checkpoints are kept and shrinks as the
groups need the pages back:

    | KV pages, lowest first -> ...  free ...  | region slot n-1 | ... | region slot 0 |
    0                                     boundary                                capacity

Each side's arrays reach only its own side of the boundary (the KV pool's pages below it, the state pool's
slots in the region: core/batch.py `PoolExtent`), so together they hold at most the pool's bytes. The
region grows over the pages below it when they are free, or cached by blocks released before its own
least recently used checkpoint (one clock for both kinds); else a new checkpoint takes that one's slot. A
group that finds no free page evicts cached blocks first, and takes the region's last slots back (those
holding nothing or an unpinned checkpoint) only when no cached block is left: a group's blocks taken at
the top would stop the region from growing back until they are released.
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
    def release_stamp(self, page: int) -> int | None: ...  # stamp of the cached block holding `page` (None: in use)
    def evict_holding(self, page: int) -> None: ...  # evict the cached block holding `page`


class RegionMember(Protocol):
    """What the pool reads of the slots in its region (state_slots.StateSlots)."""

    def num_releasable_at_edge(self) -> int: ...  # slots from the last down that are free or evictable
    def release_edge(self) -> None: ...  # forget what the last slot holds: the pool takes its pages back


class BlockPool:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free = list(range(capacity))  # a heap (sorted is one): the lowest page goes first
        self._free_set = set(self._free)
        self.members: list[PoolMember] = []
        self._holder: dict[int, PoolMember] = {}  # page -> the group whose block holds it
        self.clock = itertools.count().__next__  # release stamps, shared by every group's prefix cache
        self.region: RegionMember | None = None
        self.slot_cost = 0  # pages one region slot takes
        self.max_region_slots = 0
        self.region_slots = 0  # slots the region holds now: written here only

    def open_region(self, member: RegionMember, slot_cost: int, max_slots: int) -> None:
        """Let `member` keep up to `max_slots` slots of `slot_cost` pages each at the pool's top."""
        assert self.region is None and slot_cost > 0, "one region, of slots that take pages"
        self.region, self.slot_cost = member, slot_cost
        self.max_region_slots = min(max_slots, self.capacity // slot_cost)

    @property
    def boundary(self) -> int:
        """The first page of the region: the KV groups' pages are all below it."""
        return self.capacity - self.region_slots * self.slot_cost

    def join(self, member: PoolMember) -> None:
        self.members.append(member)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_taken(self) -> int:
        """Pages of blocks that groups hold or cache."""
        return self.boundary - len(self._free)

    @property
    def num_cached(self) -> int:
        """Pages of cached blocks no sequence references: evictable."""
        return sum(m.cost * m.num_cached_blocks for m in self.members)

    @property
    def num_releasable(self) -> int:
        """Pages of the region's last slots that hold nothing or an evictable checkpoint: a group may take them."""
        return self.region.num_releasable_at_edge() * self.slot_cost if self.region is not None else 0

    @property
    def num_available(self) -> int:
        """Pages a group can take now: free ones, those of cached blocks it may evict, the region's releasable."""
        return self.num_free + self.num_cached + self.num_releasable

    @property
    def num_pages_reached(self) -> int:
        """One past the highest page a group holds: the KV arrays must keep at least these pages."""
        return next((page + 1 for page in range(self.boundary - 1, -1, -1) if page not in self._free_set), 0)

    def take(self, member: PoolMember) -> tuple[int, ...]:
        """The pages of a new block of `member`, evicting least recently used cached blocks (of any group,
        or the region's last slot) until they are free and `member` has an id for the block. The caller
        checked that enough pages are free or cached."""
        while self.num_free < member.cost or not member.has_free_id:
            if self.num_free >= member.cost:
                member.evict_oldest()
            else:
                self._release_least_recent()
        pages = tuple(heapq.heappop(self._free) for _ in range(member.cost))
        self._free_set.difference_update(pages)
        self._holder.update(dict.fromkeys(pages, member))
        return pages

    def give(self, pages: tuple[int, ...]) -> None:
        for page in pages:
            heapq.heappush(self._free, page)
            del self._holder[page]
        self._free_set.update(pages)

    def _release_least_recent(self) -> None:
        stamped = [(stamp, i) for i, m in enumerate(self.members) if (stamp := m.oldest_release()) is not None]
        if stamped:
            self.members[min(stamped)[1]].evict_oldest()
            return
        assert self.region is not None and self.region.num_releasable_at_edge(), "the pool is full of blocks in use"
        self._shrink_region()

    # -- the region -----------------------------------------------------------------------------
    def extension_stamp(self) -> int | None:
        """What growing the region by a slot would evict: -1 when its pages are free, else the latest
        release among the cached blocks holding them; None when it cannot grow (a block there is in use)."""
        if self.region_slots >= self.max_region_slots:
            return None
        latest = -1
        for page in range(self.boundary - self.slot_cost, self.boundary):
            if page not in self._free_set:
                stamp = self._holder[page].release_stamp(page)
                if stamp is None:
                    return None
                latest = max(latest, stamp)
        return latest

    def extend_region(self, num_slots: int) -> int:
        """Grow the region by a slot (evicting the cached blocks there: `extension_stamp` said it can), and by
        up to `num_slots` - 1 more whose pages are free. Returns the slots it grew by."""
        grown = 0
        while grown < num_slots and (stamp := self.extension_stamp()) is not None and (grown == 0 or stamp < 0):
            run = range(self.boundary - self.slot_cost, self.boundary)
            for page in run:
                if page not in self._free_set:
                    self._holder[page].evict_holding(page)
            self._free_set.difference_update(run)
            self._free = [page for page in self._free if page < run.start]
            heapq.heapify(self._free)
            self.region_slots += 1
            grown += 1
        return grown

    def _shrink_region(self) -> None:
        """The region's last slot goes back to the groups, after it forgets what it holds."""
        self.region.release_edge()
        self.region_slots -= 1
        pages = range(self.boundary - self.slot_cost, self.boundary)
        for page in pages:
            heapq.heappush(self._free, page)
        self._free_set.update(pages)

    def check(self, pages_held: list[tuple[int, ...]]) -> None:
        """`pages_held`: the pages of every block the groups hold or cache."""
        held = [page for pages in pages_held for page in pages]
        assert len(set(held)) == len(held), "a page belongs to two blocks"
        assert len(set(self._free)) == len(self._free) and set(self._free) == self._free_set, "the free list"
        assert not set(held) & self._free_set, "a held page is on the free list"
        assert set(held) == set(self._holder), "the pages' holders differ from the blocks' pages"
        assert all(page < self.boundary for page in [*held, *self._free]), "a group's page is in the region"
        assert self.region_slots <= self.max_region_slots
        assert len(held) + len(self._free) == self.boundary, f"{len(held)} pages held + {len(self._free)} free"
