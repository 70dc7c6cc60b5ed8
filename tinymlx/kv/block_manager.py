"""Block accounting for the paged KV pool, behind the calls the scheduler makes.

Layers of one kind of state (full attention, a sliding window of W tokens) form a KV group with its own
ids and block tables (`GroupBlocks`, group_blocks.py), all drawing from one pool (`BlockPool`,
block_pool.py); every sequence has one block table per group, indexed by position (block i holds
positions i*bs .. i*bs+bs-1). `BlockManager` makes the scheduler's calls (allocate, grow, reserve draft
slots, trim, publish, free) on every group at once, checking the pool for all of them together. A model
with recurrent layers adds their state slots (`StateSlots`): a prefix hit must then also find a
checkpoint of the state where it resumes.

A finished (or preempted) sequence leaves its partial last block as a tail in each group's prefix cache:
a later prompt that repeats the sequence's tokens resumes inside that block, as far as they agree, rather
than at the block before it. A conversation's next turn repeats the last one's prompt (and, re-rendered,
its reply), so it no longer recomputes up to block_size - 1 of its tokens. Not with recurrent layers,
whose state exists only at block ends: their decodes leave a checkpoint at each block end of the reply
instead, so the next turn recomputes at most block_size - 1 of its tokens and its own.

A lower tier (the disk tier, kv/disk/tier.py) may hold blocks the groups no longer cache: a prefix hit then
goes on past the blocks in memory, and the blocks it restores get new blocks in the pool, filled before
the step's forward and published like computed ones. With recurrent layers it may also hold state
checkpoints: a hit can then stop at a block whose checkpoint is in memory or on disk, and one from disk is
restored into a fresh checkpoint slot (`StateSlots.install`), filled before the forward too.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Sequence_
from typing import Protocol

from tinymlx.core.batch import StateAccess
from tinymlx.core.sequence import Sequence
from tinymlx.kv.block_pool import BlockPool
from tinymlx.kv.group_blocks import NULL_BLOCK, GroupBlocks
from tinymlx.kv.prefix_cache import chain_hash
from tinymlx.kv.state_slots import StateSlots


class LowerTier(Protocol):
    """Full blocks kept below the groups' prefix caches (disk_tier.DiskTier). What it fetches is opaque
    here: the block manager only decides which blocks are restored, and into which pages. It sees pages by
    page group (`BlockManager.page_tables`), as the runner does."""

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


class BlockManager:
    """Every KV group's blocks, behind the calls the scheduler makes. `num_pages`: the pool's pages;
    `windows`: each group's sliding window (None: full attention); `costs`: the pages one block of each
    group takes (core/layer_specs.py block_costs; None: 1 each); `states`: the recurrent layers' state
    slots, if the model has any; `lower_tier`: where prefix hits go on past memory (the disk tier)."""

    def __init__(self, num_pages: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: Sequence_[int | None] = (None,), states: StateSlots | None = None,
                 checkpoint_interval: int = 16, lower_tier: LowerTier | None = None,
                 costs: Sequence_[int] | None = None):
        costs = costs or (1,) * len(windows)
        assert len(costs) == len(windows), "one cost per KV group"
        assert lower_tier is None or enable_prefix_caching, "a lower tier of the prefix cache"
        self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
        self.pool = BlockPool(num_pages)
        self.groups = [GroupBlocks(self.pool, cost, block_size, w, enable_prefix_caching) for cost, w in zip(costs, windows)]
        self.states, self.lower_tier = states, lower_tier
        # Each page group's (group, run), in order (core/layer_specs.py `page_groups`), and each group's first.
        self._runs = [(g, run) for g, cost in enumerate(costs) for run in range(cost)]
        self.first_page_group = [sum(costs[:g]) for g in range(len(costs))]
        if lower_tier is not None:
            for g, group in enumerate(self.groups):
                group.prefix_cache.on_evict = functools.partial(self._evicted, g)
        self.checkpoint_interval = checkpoint_interval  # blocks between a prompt's in-chunk checkpoints
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of those, tokens whose K/V were reused
        self.num_lower_hits = 0  # full prompt blocks restored from the lower tier
        self.num_lower_misses = 0  # full prompt blocks neither tier served: computed
        self.num_lower_checkpoints = 0  # recurrent-state checkpoints restored from the lower tier
        # Per sequence, written here only: its block table in each group, and the chained hashes of its
        # published full blocks (shared by every group).
        self._tables_of: dict[int, list[list[int]]] = {}
        self._hashes_of: dict[int, list[int]] = {}

    # -- counts (in pages of the pool) -------------------------------------------------------
    @property
    def num_pages(self) -> int:
        return self.pool.capacity

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out now: never-cached ones plus those of evictable cached blocks."""
        return self.pool.num_available

    @property
    def num_cached_pages(self) -> int:
        return self.pool.num_cached

    @property
    def num_used_pages(self) -> int:
        return self.pool.num_taken - self.pool.num_cached

    @property
    def keeps_tails(self) -> bool:
        """Whether freed sequences' partial blocks are cached: not with recurrent state (only at block ends)."""
        return self.enable_prefix_caching and self.states is None

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
        the recurrent state a hybrid model resumes from, when only the lower tier has it: a missing or bad
        one, or no checkpoint slot to put it in, moves the hit back to the checkpoint before it.
        """
        assert not self.holds_blocks(seq.seq_id), f"sequence {seq.seq_id} already holds blocks"
        hashes = self._prompt_hashes(seq)
        restorable, fetched, gone = self._restorable(hashes), {}, set()
        resumable, states_gone = self._resumable(hashes), set()
        while True:
            depth = self._hit_depth(hashes, lambda index: index not in gone and restorable(index),
                                    lambda index: index not in states_gone and resumable(index))
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
            else:  # every block is there: now the state it resumes from, if only the lower tier has it
                needs_state = self.states is not None and depth and not self.states.has_checkpoint(hashes[depth - 1][0])
                checkpoint = self._install_checkpoint(*hashes[depth - 1]) if needs_state else None
                if checkpoint is not None or not needs_state:
                    break
                states_gone.add(depth - 1)
            for group, table in zip(self.groups, tables):  # try again, shallower
                group.free(table)
        for index, block_ids in restores.items():
            self.lower_tier.restore(self._pages_by_page_group(block_ids), fetched[index])
            for group, block_id in zip(self.groups, block_ids):
                if block_id != NULL_BLOCK:
                    group.publish(*hashes[index], block_id)
        if checkpoint is not None:
            self.lower_tier.restore_checkpoint(*checkpoint)
            self.num_lower_checkpoints += 1
        self._tables_of[seq.seq_id] = tables
        self._hashes_of[seq.seq_id] = [block_hash for block_hash, _ in hashes[:depth]]
        if self.states is not None:
            self.states.admit(seq.seq_id, hashes[depth - 1][0] if depth else None, start)
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
        (which must be computed). ([None, ...], 0) when some group has none, or the model has recurrent state."""
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

    def _resumable(self, hashes: list[tuple[int, tuple[int, ...]]]) -> Callable[[int], bool]:
        """Whether a recurrent state checkpoint may exist at the end of the block at each index: in memory,
        or (asked once per index) in the lower tier, when there are checkpoint slots to restore it into."""
        if self.states is None:
            return lambda index: True
        states, lower = self.states, self.lower_tier if self.states.num_checkpoints else None
        on_lower = functools.cache(lambda index: lower is not None and lower.holds_checkpoint(hashes[index][0]))
        return lambda index: states.has_checkpoint(hashes[index][0]) or on_lower(index)

    def _install_checkpoint(self, block_hash: int, tokens: tuple[int, ...]) -> tuple[int, object] | None:
        """(slot, state) of the checkpoint at the end of this block, fetched from the lower tier into a slot
        installed now (published; filled before the forward); None when the lower tier cannot give it (a
        missing or bad file) or no slot is free."""
        data = self.lower_tier.fetch_checkpoint(block_hash, tokens) if self.lower_tier is not None else None
        slot = None if data is None else self.states.install(block_hash)
        return None if slot is None else (slot, data)

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
        if self.states is not None:
            self.states.free(seq.seq_id)

    # -- recurrent state ----------------------------------------------------------------------
    @property
    def has_recurrent_state(self) -> bool:
        return self.states is not None

    def chunk_end(self, seq: Sequence, num_tokens: int) -> int:
        """Where a chunk of up to `num_tokens` from the sequence's computed tokens may end. With recurrent
        layers only at a block end (a state exists only where a chunk stops or a checkpoint is kept) or
        at its last token, and never inside an image whose tokens attend both ways; the chunk may then be
        empty."""
        end = min(seq.num_computed_tokens + num_tokens, seq.num_tokens)
        if seq.images is not None:  # an image whose tokens attend both ways is computed in one chunk
            end = seq.images.chunk_end(seq.num_computed_tokens, end)
        if self.states is None or end >= seq.num_tokens:
            return end
        return max(seq.num_computed_tokens, end // self.block_size * self.block_size)

    def state_access(self, seq: Sequence, start: int, end: int) -> StateAccess | None:
        """The state slots of a chunk of `seq` computing tokens start..end-1, scheduled now: it reads its
        source and writes its live slot, plus a checkpoint at each block end it keeps: the chunk's end (so
        a decode leaves one at every block end of the reply, where a conversation's next turn resumes), the
        prompt's last full block, and every `checkpoint_interval` blocks (a hit is then never far short of a
        shared prefix's end). Call after `cache_full_blocks`: the hashes name them."""
        if self.states is None:
            return None
        bs, checkpoints, hashes = self.block_size, [], self._hashes_of.get(seq.seq_id, [])
        last_full = seq.num_prompt_tokens // bs
        for block in range(start // bs + 1, end // bs + 1):
            is_kept = block * bs == end or block == last_full or block % self.checkpoint_interval == 0
            if is_kept and self.enable_prefix_caching and block <= len(hashes):
                slot = self.states.reserve(seq.seq_id, hashes[block - 1])
                if slot is not None:
                    checkpoints.append((block * bs - start, slot))
        return StateAccess(*self.states.slots(seq.seq_id), tuple(checkpoints))

    def with_snapshots(self, seq: Sequence, access: StateAccess | None, num_drafts: int) -> StateAccess | None:
        """A decode's state access once it verifies `num_drafts` drafts: the states after each of its first
        `num_drafts` positions are kept too, in snapshot slots (state_slots.py), so that any number of them
        can be kept at commit."""
        if self.states is None or not num_drafts:
            return access
        snapshots = self.states.snapshot(seq.seq_id, num_drafts)
        return access._replace(checkpoints=access.checkpoints + tuple(enumerate(snapshots, start=1)))

    def commit_state(self, seq: Sequence, num_kept: int | None = None) -> None:
        """After the step that ran a chunk of `seq`: its checkpoints are published, its state is live (for a
        verified chunk, the state after its `num_kept` kept positions)."""
        if self.states is not None:
            self.states.commit(seq.seq_id, num_kept)

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

    def _hit_depth(self, hashes: list[tuple[int, tuple[int, ...]]], restorable: Callable[[int], bool],
                   resumable: Callable[[int], bool]) -> int:
        """The deepest block every group can resume at. A full group serves a prefix of the chain, a
        sliding one any point whose last window it still caches, recurrent layers any point with a state
        checkpoint (`resumable`: in memory or in the lower tier): try the full groups' depth, then
        shallower. A block the lower tier holds counts as cached in every group."""
        def has(group: GroupBlocks, index: int) -> bool:
            return group.prefix_cache.lookup(*hashes[index]) is not None or restorable(index)

        depth = 0
        while depth < len(hashes) and all(has(g, depth) for g in self.groups if not g.is_sliding):
            depth += 1
        while depth > 0 and not (all(g.can_serve(hashes, depth, restorable) for g in self.groups if g.is_sliding)
                                 and resumable(depth - 1)):
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
            pages += group.check((seq_id, tables[g], len(self._hashes_of.get(seq_id, ())))
                                 for seq_id, tables in self._tables_of.items())
        self.pool.check(pages)
        if self.states is not None:
            self.states.check(live)
