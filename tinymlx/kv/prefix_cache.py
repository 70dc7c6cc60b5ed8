"""Prefix cache: chained block hashes -> block ids, and an LRU of unreferenced cached blocks.

A full block's hash covers its own tokens and, through the previous block's hash, every token
before it, so equal hashes mean equal prefixes. The token ids are kept too and compared on every
hit, so a hash collision can never hand out the wrong K/V.

It also keeps tails: the partial last block of a finished sequence, under the hash of the full block
before it. A conversation's next turn (an agent re-sending its history) resumes inside that block, not
at the block boundary before it. A tail is handed over, not shared: the sequence that takes it writes
its own tokens past the ones it reuses, so the tail leaves the cache.

The hash is a content digest (128-bit BLAKE2b), the same in every process and on every run: the disk
tier (disk_tier.py) names its files by it.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence
from functools import lru_cache

HASH_BYTES = 16


@lru_cache(maxsize=64)
def _packer(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"<{num_tokens}q")


def chain_hash(previous_hash: int | None, token_ids: Sequence[int]) -> int:
    """The digest of the previous block's hash (0 for the first block) and this block's token ids.
    About 2.5 us a block here: a 4,096-token prompt's 255 block hashes take 0.6 ms (Python's hash() 0.1 ms)."""
    data = (previous_hash or 0).to_bytes(HASH_BYTES, "little") + _packer(len(token_ids)).pack(*token_ids)
    return int.from_bytes(hashlib.blake2b(data, digest_size=HASH_BYTES).digest(), "little")


class PrefixCache:
    """`clock`: stamps each release; the KV groups of one pool share one (block_pool.py), so their least
    recently used blocks compare across groups."""

    def __init__(self, clock: Callable[[], int] | None = None) -> None:
        self._clock = clock or itertools.count().__next__
        self._block_by_hash: dict[int, int] = {}
        self._tokens_by_block: dict[int, tuple[int, ...]] = {}
        self._hash_by_block: dict[int, int] = {}
        # Cached blocks no sequence references, oldest first, with the clock's stamp of their release:
        # reusable until memory is needed.
        self._evictable: OrderedDict[int, int] = OrderedDict()
        # Tails: block id -> (hash of the full block before it, 0 for none; the tokens it holds K/V for).
        self._tails: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._tails_by_parent: dict[int, set[int]] = {}
        # Hears (hash, tokens, block id) of each block as it is evicted, while its K/V are still intact
        # (until the step's forward overwrites them): the disk tier's chance to keep them.
        self.on_evict: Callable[[int, tuple[int, ...], int], None] | None = None

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def oldest_release(self) -> int | None:
        """The clock's stamp of the least recently released unreferenced block (None: there is none)."""
        return next(iter(self._evictable.values()), None)

    @property
    def evictable_block_ids(self) -> tuple[int, ...]:
        """Unreferenced cached blocks, least recently used first."""
        return tuple(self._evictable)

    def lookup(self, block_hash: int, token_ids: Sequence[int]) -> int | None:
        block_id = self._block_by_hash.get(block_hash)
        if block_id is None or self._tokens_by_block[block_id] != tuple(token_ids):
            return None
        return block_id

    def insert(self, block_hash: int, token_ids: Sequence[int], block_id: int) -> bool:
        """Register a freshly computed full block; False when another block already holds it."""
        if block_hash in self._block_by_hash or block_id in self._hash_by_block:
            return False
        self._block_by_hash[block_hash] = block_id
        self._hash_by_block[block_id] = block_hash
        self._tokens_by_block[block_id] = tuple(token_ids)
        return True

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_by_block

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def release(self, block_id: int) -> None:
        """The last reference to a cached block went away: keep it, most recently used last."""
        self._evictable[block_id] = self._clock()

    def reclaim(self, block_id: int) -> None:
        """A prefix hit revived an unreferenced cached block."""
        del self._evictable[block_id]

    def insert_tail(self, parent_hash: int | None, token_ids: Sequence[int], block_id: int) -> None:
        """Keep a freed sequence's partial last block, most recently used last."""
        parent = parent_hash or 0
        self._tails[block_id] = (parent, tuple(token_ids))
        self._tails_by_parent.setdefault(parent, set()).add(block_id)
        self._evictable[block_id] = self._clock()

    def match_tail(self, parent_hash: int | None, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """(block id, tokens it serves) of the tail after `parent_hash` sharing the most leading tokens
        with `token_ids`; None when none shares one."""
        best = None
        for block_id in self._tails_by_parent.get(parent_hash or 0, ()):
            held = self._tails[block_id][1]
            num = next((i for i, (a, b) in enumerate(zip(held, token_ids)) if a != b), min(len(held), len(token_ids)))
            if num and (best is None or num > best[1]):
                best = (block_id, num)
        return best

    def is_tail(self, block_id: int) -> bool:
        return block_id in self._tails

    def take_tail(self, block_id: int) -> None:
        """A sequence takes the tail over (it will write past the tokens it reuses): it leaves the cache."""
        del self._evictable[block_id]
        self._forget_tail(block_id)

    def _forget_tail(self, block_id: int) -> None:
        parent, _ = self._tails.pop(block_id)
        siblings = self._tails_by_parent[parent]
        siblings.discard(block_id)
        if not siblings:
            del self._tails_by_parent[parent]

    def release_stamp(self, block_id: int) -> int | None:
        """The clock's stamp of an unreferenced cached block's release (None: it is referenced)."""
        return self._evictable.get(block_id)

    def evict_oldest(self) -> int:
        """Forget the least recently used unreferenced block and hand its id back for reuse."""
        return self.evict(next(iter(self._evictable)))

    def evict(self, block_id: int) -> int:
        """Forget an unreferenced cached block and hand its id back for reuse."""
        del self._evictable[block_id]
        if block_id in self._tails:
            self._forget_tail(block_id)  # a tail never reaches the disk tier: it holds no full block
            return block_id
        block_hash = self._hash_by_block.pop(block_id)
        del self._block_by_hash[block_hash]
        tokens = self._tokens_by_block.pop(block_id)
        if self.on_evict is not None:
            self.on_evict(block_hash, tokens, block_id)
        return block_id

    def check(self) -> None:
        assert len(self._block_by_hash) == len(self._hash_by_block) == len(self._tokens_by_block)
        for block_hash, block_id in self._block_by_hash.items():
            assert self._hash_by_block[block_id] == block_hash, f"hash map disagrees for block {block_id}"
        for block_id in self._evictable:
            assert (block_id in self._hash_by_block) != (block_id in self._tails), \
                f"evictable block {block_id} is not exactly one of a cached block and a tail"
        assert set(self._tails) <= set(self._evictable), "a tail is referenced"
        assert {b for blocks in self._tails_by_parent.values() for b in blocks} == set(self._tails)
