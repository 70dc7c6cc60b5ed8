"""The KV coordinator: every kind of layer state, behind the calls the scheduler makes.

Each kind of layer state has a manager (kv/layer_state.py): layers of one kind of K/V (full attention, a
sliding window of W tokens) form a KV group with its own ids and block tables (group_blocks.py), all
drawing from one pool (`BlockPool`, block_pool.py); every sequence has one block table per group, indexed
by position (block i holds positions i*bs .. i*bs+bs-1). Other kinds (recurrent states, KV-shared layers)
hold no blocks. `KVCoordinator` makes the scheduler's calls (allocate, grow, reserve draft slots, trim,
publish, commit, free) on every manager at once, checking the pool for all the groups together, and asks
every manager the same questions (where a prefix hit may resume, where a chunk may end, what a chunk reads
besides K/V), never which kinds exist.

A finished (or preempted) sequence leaves its partial last block as a tail in each group's prefix cache:
a later prompt that repeats the sequence's tokens resumes inside that block, as far as they agree, rather
than at the block before it. A conversation's next turn repeats the last one's prompt (and, re-rendered,
its reply), so it no longer recomputes up to block_size - 1 of its tokens (unless a manager keeps no
tails: recurrent_states.py).

A lower tier (the disk tier, kv/disk/tier.py) may hold blocks the groups no longer cache: a prefix hit then
goes on past the blocks in memory, and the blocks it restores get new blocks in the pool, filled before
the step's forward and published like computed ones. A manager may restore its own state from it too
(`ResumeQuery.fetch`), filled before the forward as well.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Sequence_
from typing import Protocol

from tinymlx.core.batch import PoolExtent, StateAccess
from tinymlx.core.config import EngineConfig
from tinymlx.core.layer_specs import LayerSpec
from tinymlx.core.outputs import StateSlotStats
from tinymlx.core.sequence import Sequence
from tinymlx.kv.block_pool import BlockPool
from tinymlx.kv.group_blocks import NULL_BLOCK, GroupBlocks, group_blocks
from tinymlx.kv.layer_state import LayerStateManager, ResumeQuery, SharedKVLayers
from tinymlx.kv.prefix_cache import chain_hash
from tinymlx.kv.recurrent_states import RecurrentStates


class LowerTier(Protocol):
    """Full blocks kept below the groups' prefix caches (disk_tier.DiskTier). What it fetches is opaque
    here: the KV coordinator only decides which blocks are restored, and into which pages. It sees pages by
    page group (`KVCoordinator.page_tables`), as the runner does."""

    def holds(self, block_hash: int) -> bool:
        """Whether it may have this block (no I/O: an index lookup)."""

    def fetch(self, block_hash: int, tokens: tuple[int, ...]) -> object | None:
        """The block's K/V, read and verified now; None when it is missing or bad (a bad copy is dropped)."""

    def restore(self, pages: tuple[int, ...], data: object) -> None:
        """Fill these pages (one per page group; NULL_BLOCK where a group needs none) before the step's forward."""

    def evicted(self, page_group: int, block_hash: int, tokens: tuple[int, ...], page: int) -> None:
        """A group evicted a cached block, whose page in this page group stays intact until the step's forward."""

    def holds_checkpoint(self, block_hash: int) -> bool:
        """Whether it may have the recurrent state at the end of this block (no I/O)."""

    def fetch_checkpoint(self, block_hash: int, tokens: tuple[int, ...]) -> object | None:
        """That state, read and verified now; None when it is missing or bad (a bad copy is dropped)."""

    def restore_checkpoint(self, slot: int, data: object) -> None:
        """Fill this state slot (published by `StateSlots.install`) before the step's forward."""


class KVCoordinator:
    """Every kind of layer state, behind the calls the scheduler makes. `num_pages`: the pool's pages;
    `windows`: each KV group's sliding window (None: full attention); `costs`: the pages one block of each
    group takes (core/layer_specs.py block_costs; None: 1 each); `managers`: the kinds that hold no blocks
    (`managers_of` builds them for a model); `lower_tier`: where prefix hits go on past memory (the disk
    tier)."""

    def __init__(self, num_pages: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: Sequence_[int | None] = (None,), managers: Sequence_[LayerStateManager] = (),
                 lower_tier: LowerTier | None = None, costs: Sequence_[int] | None = None):
        costs = costs or (1,) * len(windows)
        assert len(costs) == len(windows), "one cost per KV group"
        assert lower_tier is None or enable_prefix_caching, "a lower tier of the prefix cache"
        self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
        self.pool = BlockPool(num_pages)
        # The managers that hold blocks (the KV groups, with a block table per sequence each), then the rest.
        self.groups: list[GroupBlocks] = [group_blocks(self.pool, cost, block_size, window, enable_prefix_caching)
                                          for cost, window in zip(costs, windows)]
        self.managers: list[LayerStateManager] = [*self.groups, *managers]
        for manager in managers:
            manager.join(self.pool)
        self.lower_tier = lower_tier
        # Each page group's (group, run), in order (core/layer_specs.py `page_groups`), and each group's first.
        self._runs = [(g, run) for g, cost in enumerate(costs) for run in range(cost)]
        self.first_page_group = [sum(costs[:g]) for g in range(len(costs))]
        if lower_tier is not None:
            for g, group in enumerate(self.groups):
                group.prefix_cache.on_evict = functools.partial(self._evicted, g)
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of those, tokens whose K/V were reused
        self.num_lower_hits = 0  # full prompt blocks restored from the lower tier
        self.num_lower_misses = 0  # full prompt blocks neither tier served: computed
        # Per sequence, written here only: its block table in each group, and the chained hashes of its
        # published full blocks (shared by every group).
        self._tables_of: dict[int, list[list[int]]] = {}
        self._hashes_of: dict[int, list[int]] = {}

    # -- counts (in pages of the pool) -------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.pool.capacity

    @property
    def num_available_pages(self) -> int:
        """Pages that can be handed out now: free ones, those of evictable cached blocks and the checkpoints'
        region's releasable ones."""
        return self.pool.num_available

    @property
    def num_free_pages(self) -> int:
        """Pages no block and no checkpoint holds."""
        return self.pool.num_free

    @property
    def num_state_pages(self) -> int:
        """Pages of the recurrent checkpoints' region at the pool's top (block_pool.py), its empty slots too."""
        return self.pool.capacity - self.pool.boundary

    @property
    def num_releasable_state_pages(self) -> int:
        """Of those, the region's last slots' pages that a sequence short of pages may take back."""
        return self.pool.num_releasable

    @property
    def num_cached_pages(self) -> int:
        return self.pool.num_cached

    @property
    def num_used_pages(self) -> int:
        return self.pool.num_taken - self.pool.num_cached

    def extent(self) -> PoolExtent:
        """How far the pools' arrays reach for the next step (block_pool.py: the region)."""
        return PoolExtent(self.pool.boundary, tuple(m.num_state_slots for m in self.managers
                                                    if m.num_state_slots is not None))

    @property
    def keeps_tails(self) -> bool:
        """Whether freed sequences' partial blocks are cached: where every manager can resume inside one."""
        return self.enable_prefix_caching and all(m.keeps_tails for m in self.managers)

    @property
    def allows_run_ahead(self) -> bool:
        """Whether a step may be scheduled before the one in flight commits (engine/run_ahead.py)."""
        return all(m.allows_run_ahead for m in self.managers)

    @property
    def num_lower_checkpoints(self) -> int:
        """States beyond blocks (recurrent checkpoints) restored from the lower tier."""
        return sum(m.num_lower_restores for m in self.managers)

    def state_slot_stats(self) -> StateSlotStats | None:
        return next((stats for m in self.managers if (stats := m.slot_stats()) is not None), None)

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def peak_blocks(self, num_tokens: int, chunk_tokens: int) -> int:
        """The most pages a sequence of `num_tokens` holds during a step computing `chunk_tokens`."""
        return sum(group.cost * group.peak_blocks(num_tokens, chunk_tokens) for group in self.groups)

    def too_large(self, num_tokens: int, chunk_tokens: int) -> tuple[int, int] | None:
        """(pages needed, pages there) when the whole pool could never hold a sequence of
        `num_tokens` computed `chunk_tokens` at a time; None when it can."""
        needed = self.peak_blocks(num_tokens, chunk_tokens)
        return (needed, self.num_pages) if needed > self.num_pages else None

    def max_num_tokens(self, chunk_tokens: int, num_sequences: int = 1) -> float:
        """The longest sequence the pool can hold `num_sequences` of at once, each computed `chunk_tokens` at a
        time (for one: too_large's bound; inf: any, when only windows hold blocks)."""
        pages = self.num_pages // num_sequences

        def fits(num_tokens: int) -> bool:
            return self.peak_blocks(num_tokens, chunk_tokens) <= pages

        if fits(sys.maxsize):
            return math.inf
        low, high = 0, pages * self.block_size  # every group's block costs at least one page
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if fits(middle) else (low, middle - 1)
        return low

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, seq: Sequence, first_chunk_tokens: int | None = None) -> int | None:
        """Give `seq` block tables, reusing the deepest cached prefix every group can serve, and a tail inside
        the block after it.

        Full-attention groups get blocks for all its tokens, sliding groups for its first chunk of up
        to `first_chunk_tokens` (None: the whole prompt; later chunks' come with `grow`). Returns the
        tokens the cache serves (the scheduler counts them computed); None, changing nothing, when the pool
        cannot hold it now.
        With a lower tier, the blocks it restores are read and verified here, before anything counts
        them as computed: a missing or bad one ends the hit there (the blocks after it are computed). So is
        what a manager resumes from when only the lower tier has it (a recurrent checkpoint): one it cannot
        have moves the hit back to where it can.
        """
        assert not self.holds_blocks(seq.seq_id), f"sequence {seq.seq_id} already holds blocks"
        hashes = self._prompt_hashes(seq)
        restorable, fetched, gone = self._restorable(hashes), {}, set()
        queries = [m.resume_query(hashes) for m in self.managers]
        while True:
            depth = self._hit_depth(len(hashes), queries, lambda index: index not in gone and restorable(index))
            tails, num_tail_tokens = self._tail_hit(seq, hashes, depth)
            start = depth * self.block_size + num_tail_tokens
            first_chunk_end = seq.num_tokens if first_chunk_tokens is None else min(seq.num_tokens, start + first_chunk_tokens)
            if seq.images is not None:  # the first chunk never ends inside an image that attends both ways
                first_chunk_end = seq.images.chunk_end(start, first_chunk_end)
            tables = self._admit(hashes, depth, seq.num_tokens, first_chunk_end, tails)
            if tables is None:
                return None
            restores = self._restores(hashes, depth, tables) if self.lower_tier is not None else {}
            for index in restores:  # in prompt order: the first block that fails ends the hit
                if index not in fetched:
                    fetched[index] = self.lower_tier.fetch(*hashes[index])
                if fetched[index] is None:
                    gone.add(index)
                    break
            else:  # every block is there: now what the other managers resume from, if only the lower tier has it
                if all(query.fetch(depth) for query in queries):
                    break
            for group, table in zip(self.groups, tables):  # try again, shallower
                group.free(table)
        for index, block_ids in restores.items():
            self.lower_tier.restore(self._pages_by_page_group(block_ids), fetched[index])
            for group, block_id in zip(self.groups, block_ids):
                if block_id != NULL_BLOCK:
                    group.publish(*hashes[index], block_id)
        for query in queries:
            query.apply()
        self._tables_of[seq.seq_id] = tables
        self._hashes_of[seq.seq_id] = [block_hash for block_hash, _ in hashes[:depth]]
        for manager in self.managers:
            manager.admit(seq.seq_id, hashes, depth, start)
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += start
        if self.lower_tier is not None:
            self.num_lower_hits += len(restores)
            self.num_lower_misses += len(hashes) - depth
        return start

    def _tail_hit(self, seq: Sequence, hashes: list[tuple[int, tuple[int, ...]]],
                  depth: int) -> tuple[list[int | None], int]:
        """(each group's tail to take over as block `depth`, the tokens they serve) for a sequence resumed at
        `depth`: the tails after block depth - 1 that share the most of its next tokens, short of its last
        (which must be computed). ([None, ...], 0) when some group has none, or a manager keeps no tails
        (`keeps_tails`: a recurrent state exists only at block ends)."""
        none: tuple[list[int | None], int] = ([None] * len(self.groups), 0)
        start = depth * self.block_size
        wanted = seq.block_keys(start, min(start + self.block_size, seq.num_tokens - 1))
        if not self.keeps_tails or not wanted:
            return none
        parent = hashes[depth - 1][0] if depth else None
        matches = [group.prefix_cache.match_tail(parent, wanted) for group in self.groups]
        if None in matches:
            return none
        return [block_id for block_id, _ in matches], min(num for _, num in matches)

    def _admit(self, hashes: list[tuple[int, tuple[int, ...]]], depth: int, num_tokens: int,
               first_chunk_end: int, tails: list[int | None]) -> list[list[int]] | None:
        """Every group's table for a sequence resumed at `depth` (taking over `tails` as block `depth`), or
        None (nothing taken) if the pool is short. Every group's hits are referenced before any group takes
        a new block: taking one may evict the least recently used cached block of any group."""
        admissions = [group.plan(hashes, depth, num_tokens, first_chunk_end, tail) for group, tail in zip(self.groups, tails)]
        if sum(group.cost_of(a) for group, a in zip(self.groups, admissions)) > self.pool.num_available:
            return None
        for group, admission in zip(self.groups, admissions):
            group.reference(admission)
        return [group.fill(admission) for group, admission in zip(self.groups, admissions)]

    def _restorable(self, hashes: list[tuple[int, tuple[int, ...]]]) -> Callable[[int], bool]:
        """Whether the lower tier may hold the block at each index (asked once per index)."""
        if self.lower_tier is None:
            return lambda index: False
        return functools.cache(lambda index: self.lower_tier.holds(hashes[index][0]))

    def _restores(self, hashes: list[tuple[int, tuple[int, ...]]], depth: int,
                  tables: list[list[int]]) -> dict[int, tuple[int, ...]]:
        """{index: the new block each group restores it into (NULL_BLOCK: cached or not needed there)}, in
        prompt order, for the blocks before `depth` that some group no longer caches."""
        restores: dict[int, list[int]] = {}
        for g, (group, table) in enumerate(zip(self.groups, tables)):
            for index in range(group.first_needed_block(depth * self.block_size), depth):
                if group.prefix_cache.lookup(*hashes[index]) is None:
                    restores.setdefault(index, [NULL_BLOCK] * len(self.groups))[g] = table[index]
        return {index: tuple(restores[index]) for index in sorted(restores)}

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Cover the first `num_tokens` of `seq` in every group; False (nothing taken) if the pool is dry."""
        tables = self._tables(seq)
        if sum(g.cost * g.blocks_to_cover(t, num_tokens) for g, t in zip(self.groups, tables)) > self.pool.num_available:
            return False
        for group, table in zip(self.groups, tables):
            group.cover(table, num_tokens)
        return True

    def append_slot(self, seq: Sequence) -> bool:
        """Grow the block tables at a block boundary so they cover every token; False if the pool is dry."""
        return self.grow(seq, seq.num_tokens)

    def can_grow_without_eviction(self, seqs: list[Sequence]) -> bool:
        """Whether every sequence's tables can cover all its tokens from free pages alone (no cached block evicted)."""
        needed = sum(group.cost * group.blocks_to_cover(table, seq.num_tokens)
                     for seq in seqs for group, table in zip(self.groups, self._tables(seq)))
        return needed <= self.pool.num_free

    def reserve_slots(self, seq: Sequence, num_extra: int) -> int:
        """Grow the block tables to cover up to `num_extra` tokens past the sequence's own (draft
        tokens to verify); returns how many every group covers. Takes only blocks that are free now:
        draft slots never cost anyone a preemption."""
        tables = self._tables(seq)
        return min(g.reserve(t, seq.num_tokens, num_extra) for g, t in zip(self.groups, tables))

    def trim(self, seq: Sequence) -> None:
        """After a step: give back the blocks that held rejected drafts, and those no window reaches."""
        for group, table in zip(self.groups, self._tables(seq)):
            group.trim(table, seq.num_tokens, seq.num_computed_tokens)

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Publish, in every group, the blocks that are full once `num_computed_tokens` tokens have K/V.

        Called when a chunk is scheduled: within a step every layer writes all new K/V before
        any sequence reads, so a sequence admitted in the same step may already hit them.
        """
        if not self.enable_prefix_caching:
            return
        bs, tables, hashes = self.block_size, self._tables(seq), self._hashes_of.setdefault(seq.seq_id, [])
        for index in range(len(hashes), num_computed_tokens // bs):
            tokens = seq.block_keys(index * bs, (index + 1) * bs)
            block_hash = chain_hash(hashes[-1] if hashes else None, tokens)
            for group, table in zip(self.groups, tables):
                group.publish(block_hash, tokens, table[index])
            hashes.append(block_hash)

    def free(self, seq: Sequence) -> None:
        tail = None
        hashes = self._hashes_of.pop(seq.seq_id, [])
        index, num_tail_tokens = divmod(seq.num_computed_tokens, self.block_size)
        if num_tail_tokens and self.keeps_tails and index == len(hashes):
            start = index * self.block_size
            tail = (index, hashes[-1] if index else None, seq.block_keys(start, start + num_tail_tokens))
        for group, table in zip(self.groups, self._tables_of.pop(seq.seq_id, ())):
            group.free(table, tail)
        for manager in self.managers:
            manager.release(seq.seq_id)

    # -- a chunk's state besides its blocks ---------------------------------------------------
    def chunk_end(self, seq: Sequence, num_tokens: int) -> int:
        """Where a chunk of up to `num_tokens` from the sequence's computed tokens may end: where every
        manager allows (a recurrent state exists only at block ends), and never inside an image whose
        tokens attend both ways. The chunk may then be empty."""
        end = min(seq.num_computed_tokens + num_tokens, seq.num_tokens)
        if seq.images is not None:  # an image whose tokens attend both ways is computed in one chunk
            end = seq.images.chunk_end(seq.num_computed_tokens, end)
        for manager in self.managers:
            end = manager.chunk_end(seq, end)
        return end

    def can_begin(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether a waiting sequence's first chunk could end within `num_tokens` (looked at before its
        prefix hit is, so nothing is allocated for a sequence that must wait for a larger budget)."""
        end = min(seq.num_computed_tokens + num_tokens, seq.num_tokens)
        return all(manager.chunk_end(seq, end) > seq.num_computed_tokens for manager in self.managers)

    def state_access(self, seq: Sequence, start: int, end: int) -> StateAccess | None:
        """What a chunk of `seq` computing tokens start..end-1, scheduled now, reads and writes besides K/V
        (one kind at most has any: a recurrent model's state slots). Call after `cache_full_blocks`: the
        hashes name the blocks it ends."""
        hashes = self._hashes_of.get(seq.seq_id, [])
        accesses = [access for m in self.managers
                    if (access := m.state_access(seq.seq_id, start, end, seq.num_prompt_tokens, hashes)) is not None]
        assert len(accesses) <= 1, "two kinds of state read by one chunk"
        return accesses[0] if accesses else None

    def with_snapshots(self, seq: Sequence, access: StateAccess | None, num_drafts: int) -> StateAccess | None:
        """A decode's access once it verifies `num_drafts` drafts: with what rolling any of them back needs."""
        for manager in self.managers:
            access = manager.with_snapshots(seq.seq_id, access, num_drafts)
        return access

    def commit_state(self, seq: Sequence, num_kept: int | None = None) -> None:
        """After the step that ran a chunk of `seq`: what it wrote besides K/V is published (for a verified
        chunk, what its `num_kept` kept positions left)."""
        for manager in self.managers:
            manager.commit(seq.seq_id, num_kept)

    # -- helpers ------------------------------------------------------------------------------
    def _tables(self, seq: Sequence) -> list[list[int]]:
        return self._tables_of.setdefault(seq.seq_id, [[] for _ in self.groups])

    # -- what others read -----------------------------------------------------------------------
    def holds_blocks(self, seq_id: int) -> bool:
        return any(self._tables_of.get(seq_id, ()))

    def block_tables(self, seq_id: int) -> tuple[tuple[int, ...], ...]:
        """The sequence's block table in each group, as they are now (() : it holds none)."""
        return tuple(tuple(table) for table in self._tables_of.get(seq_id, ()))

    def block_hashes(self, seq_id: int) -> list[int]:
        """The chained hashes of the sequence's published full blocks (a copy)."""
        return list(self._hashes_of.get(seq_id, ()))

    def _prompt_hashes(self, seq: Sequence) -> list[tuple[int, tuple[int, ...]]]:
        """(chained hash, tokens) of the full blocks before the sequence's last token (at least one token
        must be computed: the last one produces the next token's logits)."""
        if not self.enable_prefix_caching:
            return []
        bs, hashes, previous = self.block_size, [], None
        for index in range((seq.num_tokens - 1) // bs):
            tokens = seq.block_keys(index * bs, (index + 1) * bs)
            previous = chain_hash(previous, tokens)
            hashes.append((previous, tokens))
        return hashes

    @staticmethod
    def _hit_depth(num_blocks: int, queries: list[ResumeQuery], restorable: Callable[[int], bool]) -> int:
        """The deepest block every manager can resume at: the shallowest bound they give (a full group's
        cached prefix of the chain), then shallower until all agree (a window must still cache its last
        window, a recurrent state needs a checkpoint). A block the lower tier holds counts as cached."""
        depth = min((query.deepest(num_blocks, restorable) for query in queries), default=num_blocks)
        while depth > 0 and not all(query.can_resume(depth, restorable) for query in queries):
            depth -= 1
        return depth

    def page_tables(self, seq: Sequence) -> tuple[tuple[int, ...], ...]:
        """The sequence's page table in each page group (NULL_BLOCK where its group's table has one): what the
        runner reads, each run of a group's layers through its own."""
        tables = []
        for group, table in zip(self.groups, self._tables_of.get(seq.seq_id) or [()] * len(self.groups)):
            pages = group.pages
            tables += [tuple(NULL_BLOCK if b == NULL_BLOCK else pages[b][run] for b in table) for run in range(group.cost)]
        return tuple(tables)

    def cached_page(self, page_group: int, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        """The page caching this full block in page group `page_group`, if any."""
        g, run = self._runs[page_group]
        block_id = self.groups[g].prefix_cache.lookup(block_hash, tokens)
        return None if block_id is None else self.groups[g].pages[block_id][run]

    def _pages_by_page_group(self, block_ids: tuple[int, ...]) -> tuple[int, ...]:
        """Each group's block (NULL_BLOCK: none) as its page in each of the group's page groups."""
        return tuple(NULL_BLOCK if b == NULL_BLOCK else group.pages[b][run]
                     for group, b in zip(self.groups, block_ids) for run in range(group.cost))

    def _evicted(self, g: int, block_hash: int, tokens: tuple[int, ...], block_id: int) -> None:
        for run, page in enumerate(self.groups[g].pages[block_id]):
            self.lower_tier.evicted(self.first_page_group[g] + run, block_hash, tokens, page)

    # -- integrity ----------------------------------------------------------------------------
    def check(self, live_sequences: Iterable[Sequence]) -> None:
        """Assert every invariant; `live_sequences` are all sequences that may hold blocks."""
        live = {seq.seq_id for seq in live_sequences}
        assert set(self._tables_of) <= live and set(self._hashes_of) <= live, \
            f"blocks of sequences no longer live: {sorted((set(self._tables_of) | set(self._hashes_of)) - live)}"
        for seq_id, tables in self._tables_of.items():
            assert len(tables) == len(self.groups), f"seq {seq_id}'s tables"
        pages = []
        for g, group in enumerate(self.groups):
            pages += group.check_blocks((seq_id, tables[g], len(self._hashes_of.get(seq_id, ())))
                                        for seq_id, tables in self._tables_of.items())
        self.pool.check(pages)
        for manager in self.managers:
            manager.check(live)


def managers_of(specs: tuple[LayerSpec, ...], config: EngineConfig,
                lower_tier: LowerTier | None = None) -> list[LayerStateManager]:
    """The managers of a model's kinds of layer state that hold no blocks (the KV groups' come with the
    pool: KVCoordinator's `windows` and `costs`): each kind's module says whether the model has it."""
    return [*RecurrentStates.for_model(specs, config, lower_tier), *SharedKVLayers.for_model(specs)]
