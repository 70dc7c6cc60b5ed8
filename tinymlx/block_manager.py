"""Block accounting for the paged KV pool: free list, refcounts, prefix reuse, integrity check.

Every block is in exactly one of three states:
    free       ref 0, no hash         in `_free`
    cached     ref 0, hashed          in the prefix cache's LRU (reusable, evictable)
    used       ref > 0                in one or more block tables (hashed or not)
Full blocks are shared read-only between sequences with the same prefix; a sequence only ever
writes to its own partial last block, so sharing needs no copy-on-write.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

from tinymlx.prefix_cache import PrefixCache, chain_hash
from tinymlx.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.prefix_cache = PrefixCache()
        self.num_queried_tokens = 0  # prompt tokens looked up in the prefix cache
        self.num_hit_tokens = 0  # of those, tokens whose K/V were reused

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: never-cached ones plus evictable cached ones."""
        return len(self._free) + self.prefix_cache.num_evictable

    @property
    def num_cached_blocks(self) -> int:
        return self.prefix_cache.num_evictable

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, seq: Sequence) -> bool:
        """Give `seq` blocks for all its tokens, reusing its longest cached prefix.

        Sets the block table and `num_computed_tokens`; returns False and changes nothing when
        the pool cannot hold the sequence now.
        """
        assert not seq.block_table, f"sequence {seq.seq_id} already holds blocks"
        hits = self._match_prefix(seq)
        num_new = self.num_blocks_for(seq.num_tokens) - len(hits)
        num_revived = sum(self.prefix_cache.is_evictable(block_id) for _, block_id in hits)
        if num_new > self.num_free_blocks - num_revived:
            return False
        for _, block_id in hits:
            self._add_ref(block_id)
        seq.block_table = [block_id for _, block_id in hits] + [self._take_block() for _ in range(num_new)]
        seq.block_hashes = [block_hash for block_hash, _ in hits]
        seq.num_computed_tokens = len(hits) * self.block_size
        self.num_queried_tokens += seq.num_tokens
        self.num_hit_tokens += seq.num_computed_tokens
        return True

    def append_slot(self, seq: Sequence) -> bool:
        """Grow the block table at a block boundary so it covers every token; False if the pool is dry."""
        if len(seq.block_table) * self.block_size >= seq.num_tokens:
            return True
        if self.num_free_blocks == 0:
            return False
        seq.block_table.append(self._take_block())
        return True

    def reserve_slots(self, seq: Sequence, num_extra: int) -> int:
        """Grow the block table to cover up to `num_extra` tokens past the sequence's own (draft
        tokens to verify); returns how many it covers. Takes only blocks that are free now: draft
        slots never cost anyone a preemption."""
        bs, covered = self.block_size, len(seq.block_table) * self.block_size - seq.num_tokens
        while covered < num_extra and self.num_free_blocks > 0:
            seq.block_table.append(self._take_block())
            covered += bs
        return max(0, min(num_extra, covered))

    def truncate(self, seq: Sequence) -> None:
        """Give back blocks past the sequence's tokens: those that held rejected drafts. They were
        never published (only blocks full of verified tokens are), so they return to the free list."""
        keep = self.num_blocks_for(seq.num_tokens)
        while len(seq.block_table) > keep:
            block_id = seq.block_table.pop()
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] == 0 and not self.prefix_cache.is_cached(block_id)
            self._free.append(block_id)

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Publish the blocks that are full once `num_computed_tokens` tokens have K/V.

        Called when a chunk is scheduled: within a step every layer writes all new K/V before
        any sequence reads, so a sequence admitted in the same step may already hit them.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for index in range(len(seq.block_hashes), num_computed_tokens // bs):
            tokens = seq.token_ids[index * bs:(index + 1) * bs]
            previous = seq.block_hashes[-1] if seq.block_hashes else None
            block_hash = chain_hash(previous, tokens)
            self.prefix_cache.insert(block_hash, tokens, seq.block_table[index])
            seq.block_hashes.append(block_hash)

    def free(self, seq: Sequence) -> None:
        # Release the tail first so a prefix outlives its extensions in the LRU.
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.prefix_cache.is_cached(block_id):
                    self.prefix_cache.release(block_id)
                else:
                    self._free.append(block_id)
        seq.block_table, seq.block_hashes = [], []

    # -- helpers ------------------------------------------------------------------------------
    def _match_prefix(self, seq: Sequence) -> list[tuple[int, int]]:
        if not self.enable_prefix_caching:
            return []
        bs, hits, previous = self.block_size, [], None
        # At least one token must be computed: the last one produces the next token's logits.
        for index in range((seq.num_tokens - 1) // bs):
            tokens = seq.token_ids[index * bs:(index + 1) * bs]
            previous = chain_hash(previous, tokens)
            block_id = self.prefix_cache.lookup(previous, tokens)
            if block_id is None:
                break
            hits.append((previous, block_id))
        return hits

    def _add_ref(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            self.prefix_cache.reclaim(block_id)
        self.ref_counts[block_id] += 1

    def _take_block(self) -> int:
        block_id = self._free.popleft() if self._free else self.prefix_cache.evict_oldest()
        self.ref_counts[block_id] = 1
        return block_id

    # -- integrity ----------------------------------------------------------------------------
    def check(self, live_sequences: Iterable[Sequence]) -> None:
        """Assert every invariant; `live_sequences` are all sequences that may hold blocks."""
        expected = [0] * self.num_blocks
        for seq in live_sequences:
            assert len(set(seq.block_table)) == len(seq.block_table), f"seq {seq.seq_id} repeats a block"
            assert len(seq.block_hashes) <= len(seq.block_table)
            for block_id in seq.block_table:
                expected[block_id] += 1
        assert expected == self.ref_counts, "refcounts differ from live block-table references"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block_id in range(self.num_blocks):
            is_free, is_evictable = block_id in free, self.prefix_cache.is_evictable(block_id)
            used = self.ref_counts[block_id] > 0
            assert is_free + is_evictable + used == 1, f"block {block_id} is in {is_free + is_evictable + used} states"
            assert not (is_free and self.prefix_cache.is_cached(block_id)), f"free block {block_id} still hashed"
        self.prefix_cache.check()
