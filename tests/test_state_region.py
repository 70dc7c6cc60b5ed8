"""Recurrent-state checkpoints as pages of the KV pool (kv/block_pool.py's region), on the pool's own
accounting: the region grows over free pages, and over cached blocks released before its least recently
used checkpoint (one clock for both); else a new checkpoint takes that one's slot. A group short of pages
evicts cached blocks first and takes the region's last slot back only when none is left. The groups'
pages and the region never overlap (check() after every call)."""

from __future__ import annotations

from test_kv_coordinator import BS, admitted, computed, make_seq
from tiny_models import allocate

from tinymlx.kv.coordinator import KVCoordinator
from tinymlx.kv.state_slots import StateSlots

COST = 3  # pages one checkpoint takes
WRITER = 7  # the sequence whose chunks keep the checkpoints


def checked(kv: KVCoordinator, slots: StateSlots, seqs=(), readers=()) -> None:
    kv.check(list(seqs))
    slots.check([WRITER, *readers])
    assert kv.pool.boundary == kv.pool.capacity - kv.pool.region_slots * COST
    assert slots.num_slots == slots.base + kv.pool.region_slots


def keep(kv: KVCoordinator, slots: StateSlots, block_hash: int) -> int | None:
    """The writer's chunk keeps the checkpoint of `block_hash`, published at its commit."""
    slot = slots.reserve(WRITER, block_hash)
    slots.commit(WRITER)
    checked(kv, slots)
    return slot


def cached_blocks(kv: KVCoordinator, tokens: list[int], seq_id: int) -> None:
    """A finished sequence's full blocks, left cached."""
    seq = computed(kv, admitted(kv, make_seq(tokens, seq_id)))
    kv.free(seq)


def test_checkpoints_share_the_pool_with_blocks_by_one_clock():
    kv = KVCoordinator(num_pages=12, block_size=BS)
    slots = StateSlots(num_live=2, num_checkpoints=4)
    slots.join(kv.pool, COST)
    slots.admit(WRITER, None, 0)

    # Free pages: the region grows over them, from the top, by as many slots as live ones at first.
    first = keep(kv, slots, 101)
    assert first == slots.base and kv.pool.boundary == 6
    cached_blocks(kv, list(range(2 * BS)), seq_id=1)  # pages 0, 1, released after checkpoint 101
    keep(kv, slots, 102)
    assert kv.pool.boundary == 6 and slots.has_checkpoint(101)

    # The pages below are cached by blocks released after 101: 103 takes 101's slot instead.
    cached_blocks(kv, list(range(100, 100 + 4 * BS)), seq_id=2)  # pages 2 .. 5
    assert kv.pool.num_free == 0
    assert keep(kv, slots, 103) == first
    assert not slots.has_checkpoint(101) and kv.pool.boundary == 6 and kv.num_cached_pages == 6

    # Both checkpoints read again (newer than every cached block): the region grows over the oldest blocks.
    for seq_id, block_hash in ((8, 102), (9, 103)):
        slots.admit(seq_id, block_hash, BS)
        slots.free(seq_id)
    keep(kv, slots, 104)
    assert kv.pool.boundary == 3 and kv.num_cached_pages == 3 and slots.num_cached_checkpoints == 3
    assert all(slots.has_checkpoint(h) for h in (102, 103, 104))

    # A sequence that needs more pages than the cached blocks: the region's last slot goes back, then.
    seq = admitted(kv, make_seq(list(range(200, 200 + 4 * BS)), seq_id=3))
    assert kv.pool.boundary == 6 and not slots.has_checkpoint(104)
    assert kv.num_cached_pages == 0 and slots.num_cached_checkpoints == 2
    checked(kv, slots, [seq])

    # A checkpoint a sequence resumes from is pinned: the region's last slot is not given back under it.
    kv.free(seq)
    edge = slots._hash_in[slots.num_slots - 1]
    slots.admit(10, edge, BS)
    checked(kv, slots, readers=[10])
    assert kv.pool.num_available == kv.pool.boundary
    assert not allocate(kv, make_seq(list(range(300, 300 + (kv.pool.boundary + 1) * BS)), seq_id=4))
    slots.free(10)
    slots.free(WRITER)
    slots.check([])
    assert kv.pool.num_available == kv.pool.capacity  # every page: free, or an evictable checkpoint's
