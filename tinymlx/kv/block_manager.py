"""Block accounting for the paged KV pool, behind the calls the scheduler makes.

Layers of one kind of state (full attention, a sliding window of W tokens) form a KV group with its own
pool of blocks (`GroupBlocks`, group_blocks.py); every sequence has one block table per group, indexed
by position (block i holds positions i*bs .. i*bs+bs-1). `BlockManager` makes the scheduler's calls
(allocate, grow, reserve draft slots, trim, publish, free) on every group at once. A model with
recurrent layers adds their state slots (`StateSlots`): a prefix hit must then also find a checkpoint of
the state where it resumes.

A finished (or preempted) sequence leaves its partial last block as a tail in each group's prefix cache:
a later prompt that repeats the sequence's tokens resumes inside that block, as far as they agree, rather
than at the block before it. A conversation's next turn repeats the last one's prompt (and, re-rendered,
its reply), so it no longer recomputes up to block_size - 1 of its tokens. Not with recurrent layers,
whose state exists only at block ends.

A lower tier (the disk tier, disk_tier.py) may hold blocks the groups no longer cache: a prefix hit then
goes on past the blocks in memory, and the blocks it restores get new blocks in the pool, filled before
the step's forward and published like computed ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Sequence_
from typing import Protocol

from tinymlx.core.batch import StateAccess
from tinymlx.core.sequence import Sequence
from tinymlx.kv.group_blocks import NULL_BLOCK, GroupBlocks
from tinymlx.kv.prefix_cache import chain_hash
from tinymlx.kv.state_slots import StateSlots


class LowerTier(Protocol):
    """Full blocks kept below the groups' prefix caches (disk_tier.DiskTier). What it fetches is opaque
    here: the block manager only decides which blocks are restored, and into which blocks."""

    def holds(self, block_hash: int) -> bool:
        """Whether it may have this block (no I/O: an index lookup)."""

    def fetch(self, block_hash: int, tokens: tuple[int, ...]) -> object | None:
        """The block's K/V, read and verified now; None when it is missing or bad (a bad copy is dropped)."""

    def restore(self, block_ids: tuple[int, ...], data: object) -> None:
        """Fill these blocks (one per KV group; NULL_BLOCK where a group needs none) before the step's forward."""

    def evicted(self, group: int, block_hash: int, tokens: tuple[int, ...], block_id: int) -> None:
        """A group evicted a cached block; its K/V stay intact until the step's forward."""


class BlockManager:
    """Every KV group's blocks, behind the calls the scheduler makes. `num_blocks`: one count for
    every group, or one per group; `windows`: each group's sliding window (None: full attention);
    `states`: the recurrent layers' state slots, if the model has any; `lower_tier`: where prefix hits
    go on past memory (the disk tier)."""

    def __init__(self, num_blocks: int | Sequence_[int], block_size: int, enable_prefix_caching: bool = True,
                 windows: Sequence_[int | None] = (None,), states: StateSlots | None = None,
                 checkpoint_interval: int = 16, lower_tier: LowerTier | None = None):
        counts = [num_blocks] * len(windows) if isinstance(num_blocks, int) else list(num_blocks)
        assert len(counts) == len(windows), "one block count per KV group"
        assert lower_tier is None or (enable_prefix_caching and states is None), "a lower tier of the prefix cache"
        self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
        self.groups = [GroupBlocks(n, block_size, w, enable_prefix_caching) for n, w in zip(counts, windows)]
        self.states, self.lower_tier = states, lower_tier
        if lower_tier is not None:
            for g, group in enumerate(self.groups):
                group.prefix_cache.on_evict = functools.partial(lower_tier.evicted, g)
        self.checkpoint_interval = checkpoint_interval  # blocks between a prompt's in-chunk checkpoints
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of those, tokens whose K/V were reused
        self.num_lower_hits = 0  # full prompt blocks restored from the lower tier
        self.num_lower_misses = 0  # full prompt blocks neither tier served: computed

    # -- counts (summed over the groups) --------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return sum(g.num_blocks for g in self.groups)

    @property
    def num_free_blocks(self) -> int:
        return sum(g.num_free_blocks for g in self.groups)

    @property
    def num_cached_blocks(self) -> int:
        return sum(g.num_cached_blocks for g in self.groups)

    @property
    def num_used_blocks(self) -> int:
        return sum(g.num_used_blocks for g in self.groups)

    @property
    def keeps_tails(self) -> bool:
        """Whether freed sequences' partial blocks are cached: not with recurrent state (only at block ends)."""
        return self.enable_prefix_caching and self.states is None

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def too_large(self, num_tokens: int, chunk_tokens: int) -> tuple[int, int] | None:
        """(blocks needed, blocks there) in the first group that could never hold a sequence of
        `num_tokens` computed `chunk_tokens` at a time; None when every group can."""
        for group in self.groups:
            needed = group.peak_blocks(num_tokens, chunk_tokens)
            if needed > group.num_blocks:
                return needed, group.num_blocks
        return None

    def max_num_tokens(self, chunk_tokens: int) -> float:
        """The longest sequence every group can hold, computed `chunk_tokens` at a time (too_large's bound)."""
        return min(group.max_num_tokens(chunk_tokens) for group in self.groups)

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, seq: Sequence, first_chunk_tokens: int | None = None) -> bool:
        """Give `seq` block tables, reusing the deepest cached prefix every group can serve, and a tail inside
        the block after it.

        Full-attention groups get blocks for all its tokens, sliding groups for its first chunk of up
        to `first_chunk_tokens` (None: the whole prompt; later chunks' come with `grow`). Sets
        `num_computed_tokens`; returns False and changes nothing when the pools cannot hold it now.
        With a lower tier, the blocks it restores are read and verified here, before anything counts
        them as computed: a missing or bad one ends the hit there (the blocks after it are computed).
        """
        assert not any(seq.block_tables), f"sequence {seq.seq_id} already holds blocks"
        hashes = self._prompt_hashes(seq)
        restorable, fetched, gone = self._restorable(hashes), {}, set()
        while True:
            depth = self._hit_depth(hashes, lambda index: index not in gone and restorable(index))
            tails, num_tail_tokens = self._tail_hit(seq, hashes, depth)
            start = depth * self.block_size + num_tail_tokens
            first_chunk_end = seq.num_tokens if first_chunk_tokens is None else min(seq.num_tokens, start + first_chunk_tokens)
            tables = self._admit(hashes, depth, seq.num_tokens, first_chunk_end, tails)
            if tables is None:
                return False
            restores = self._restores(hashes, depth, tables) if self.lower_tier is not None else {}
            for index in restores:  # in prompt order: the first block that fails ends the hit
                if index not in fetched:
                    fetched[index] = self.lower_tier.fetch(*hashes[index])
                if fetched[index] is None:
                    gone.add(index)
                    break
            else:
                break
            for group, table in zip(self.groups, tables):  # try again, shallower
                group.free(table)
        for index, block_ids in restores.items():
            self.lower_tier.restore(block_ids, fetched[index])
            for group, block_id in zip(self.groups, block_ids):
                if block_id != NULL_BLOCK:
                    group.publish(*hashes[index], block_id)
        seq.block_tables = tables
        seq.block_hashes = [block_hash for block_hash, _ in hashes[:depth]]
        seq.num_computed_tokens = start
        if self.states is not None:
            self.states.admit(seq, hashes[depth - 1][0] if depth else None, seq.num_computed_tokens)
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += seq.num_computed_tokens
        if self.lower_tier is not None:
            self.num_lower_hits += len(restores)
            self.num_lower_misses += len(hashes) - depth
        return True

    def _tail_hit(self, seq: Sequence, hashes: list[tuple[int, tuple[int, ...]]],
                  depth: int) -> tuple[list[int | None], int]:
        """(each group's tail to take over as block `depth`, the tokens they serve) for a sequence resumed at
        `depth`: the tails after block depth - 1 that share the most of its next tokens, short of its last
        (which must be computed). ([None, ...], 0) when some group has none, or the model has recurrent state."""
        none: tuple[list[int | None], int] = ([None] * len(self.groups), 0)
        start = depth * self.block_size
        wanted = seq.token_ids[start:min(start + self.block_size, seq.num_tokens - 1)]
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
        None (nothing taken) if a pool is short."""
        tables = []
        for group, tail in zip(self.groups, tails):
            table = group.admit(hashes, depth, num_tokens, first_chunk_end, tail)
            if table is None:
                for admitted, taken in zip(self.groups, tables):
                    admitted.free(taken)
                return None
            tables.append(table)
        return tables

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
        """Cover the first `num_tokens` of `seq` in every group; False (nothing taken) if a pool is dry."""
        tables = self._tables(seq)
        if any(g.blocks_to_cover(t, num_tokens) > g.num_free_blocks for g, t in zip(self.groups, tables)):
            return False
        for group, table in zip(self.groups, tables):
            group.cover(table, num_tokens)
        return True

    def append_slot(self, seq: Sequence) -> bool:
        """Grow the block tables at a block boundary so they cover every token; False if a pool is dry."""
        return self.grow(seq, seq.num_tokens)

    def can_grow_without_eviction(self, seqs: list[Sequence]) -> bool:
        """Whether every sequence's tables can cover all its tokens from never-cached free blocks alone."""
        tables = [self._tables(seq) for seq in seqs]
        return all(sum(group.blocks_to_cover(t[g], seq.num_tokens) for seq, t in zip(seqs, tables))
                   <= group.num_free_blocks - group.num_cached_blocks for g, group in enumerate(self.groups))

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
        bs, tables = self.block_size, self._tables(seq)
        for index in range(len(seq.block_hashes), num_computed_tokens // bs):
            tokens = tuple(seq.token_ids[index * bs:(index + 1) * bs])
            previous = seq.block_hashes[-1] if seq.block_hashes else None
            block_hash = chain_hash(previous, tokens)
            for group, table in zip(self.groups, tables):
                group.publish(block_hash, tokens, table[index])
            seq.block_hashes.append(block_hash)

    def free(self, seq: Sequence) -> None:
        tail = None
        index, num_tail_tokens = divmod(seq.num_computed_tokens, self.block_size)
        if num_tail_tokens and self.keeps_tails and index == len(seq.block_hashes):
            start = index * self.block_size
            tail = (index, seq.block_hashes[-1] if index else None, tuple(seq.token_ids[start:start + num_tail_tokens]))
        for group, table in zip(self.groups, self._tables(seq)):
            group.free(table, tail)
        seq.block_tables, seq.block_hashes = [], []
        if self.states is not None:
            self.states.free(seq)

    # -- recurrent state ----------------------------------------------------------------------
    @property
    def has_recurrent_state(self) -> bool:
        return self.states is not None

    def chunk_end(self, seq: Sequence, num_tokens: int) -> int:
        """Where a chunk of up to `num_tokens` from the sequence's computed tokens may end. With recurrent
        layers only at a block end (a state exists only where a chunk stops or a checkpoint is kept) or
        at its last token; the chunk may then be empty."""
        end = seq.num_computed_tokens + num_tokens
        if self.states is None or end >= seq.num_tokens:
            return min(end, seq.num_tokens)
        return max(seq.num_computed_tokens, end // self.block_size * self.block_size)

    def state_access(self, seq: Sequence, start: int, end: int) -> StateAccess | None:
        """The state slots of a chunk of `seq` computing tokens start..end-1, scheduled now: it reads its
        source and writes its live slot, plus a checkpoint at each prompt block end it keeps: the chunk's
        end, the prompt's last full block, and every `checkpoint_interval` blocks (a hit is then never
        far short of a shared prefix's end). Call after `cache_full_blocks`: the hashes name them."""
        if self.states is None:
            return None
        bs, checkpoints = self.block_size, []
        last_full = seq.num_prompt_tokens // bs
        for block in range(start // bs + 1, min(end, seq.num_prompt_tokens) // bs + 1):
            is_kept = block * bs == end or block == last_full or block % self.checkpoint_interval == 0
            if is_kept and self.enable_prefix_caching and block <= len(seq.block_hashes):
                slot = self.states.reserve(seq, seq.block_hashes[block - 1])
                if slot is not None:
                    checkpoints.append((block * bs - start, slot))
        return StateAccess(seq.state_source, seq.state_slot, tuple(checkpoints))

    def commit_state(self, seq: Sequence) -> None:
        """After the step that ran a chunk of `seq`: its checkpoints are published, its state is live."""
        if self.states is not None:
            self.states.commit(seq)

    # -- helpers ------------------------------------------------------------------------------
    def _tables(self, seq: Sequence) -> list[list[int]]:
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.groups]
        return seq.block_tables

    def _prompt_hashes(self, seq: Sequence) -> list[tuple[int, tuple[int, ...]]]:
        """(chained hash, tokens) of the full blocks before the sequence's last token (at least one token
        must be computed: the last one produces the next token's logits)."""
        if not self.enable_prefix_caching:
            return []
        bs, hashes, previous = self.block_size, [], None
        for index in range((seq.num_tokens - 1) // bs):
            tokens = tuple(seq.token_ids[index * bs:(index + 1) * bs])
            previous = chain_hash(previous, tokens)
            hashes.append((previous, tokens))
        return hashes

    def _hit_depth(self, hashes: list[tuple[int, tuple[int, ...]]],
                   restorable: Callable[[int], bool] = lambda index: False) -> int:
        """The deepest block every group can resume at. A full group serves a prefix of the chain, a
        sliding one any point whose last window it still caches, recurrent layers any point with a state
        checkpoint: try the full groups' depth, then shallower. A block the lower tier holds counts as
        cached in every group."""
        def has(group: GroupBlocks, index: int) -> bool:
            return group.prefix_cache.lookup(*hashes[index]) is not None or restorable(index)

        depth = 0
        while depth < len(hashes) and all(has(g, depth) for g in self.groups if not g.is_sliding):
            depth += 1
        while depth > 0 and not (all(g.can_serve(hashes, depth, restorable) for g in self.groups if g.is_sliding)
                                 and (self.states is None or self.states.has_checkpoint(hashes[depth - 1][0]))):
            depth -= 1
        return depth

    def cached_block(self, group: int, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        """The block caching this full block in group `group`, if any."""
        return self.groups[group].prefix_cache.lookup(block_hash, tokens)

    # -- integrity ----------------------------------------------------------------------------
    def check(self, live_sequences: Iterable[Sequence]) -> None:
        """Assert every invariant; `live_sequences` are all sequences that may hold blocks."""
        live = list(live_sequences)
        for seq in live:
            assert not seq.block_tables or len(seq.block_tables) == len(self.groups), f"seq {seq.seq_id}'s tables"
        for g, group in enumerate(self.groups):
            group.check((s.seq_id, s.block_tables[g], len(s.block_hashes)) for s in live if s.block_tables)
        if self.states is not None:
            self.states.check(live)
