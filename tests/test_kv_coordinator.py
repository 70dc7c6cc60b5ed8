"""Block accounting and prefix caching: refcounts, sharing, LRU eviction, no stale hits."""

from __future__ import annotations

import pytest
from tiny_models import allocate

from tinymlx.core.request import ValidRequest
from tinymlx.core.sampling_params import SamplingParams
from tinymlx.core.sequence import Sequence
from tinymlx.kv.coordinator import KVCoordinator

BS = 4


def make_seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, ValidRequest(list(tokens), SamplingParams(), request_id=f"r{seq_id}"))


def computed(bm: KVCoordinator, seq: Sequence) -> Sequence:
    """Pretend every token of `seq` was run through the model and publish its full blocks."""
    bm.cache_full_blocks(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    return seq


def admitted(bm: KVCoordinator, seq: Sequence) -> Sequence:
    assert allocate(bm, seq)
    return seq


@pytest.fixture
def bm():
    manager = KVCoordinator(num_pages=8, block_size=BS)
    yield manager
    assert manager.num_used_pages + manager.num_cached_pages + len(manager.groups[0]._free) == manager.num_pages


def test_allocate_covers_all_tokens_with_bounded_fragmentation(bm):
    seq = make_seq(range(10))
    assert allocate(bm, seq)
    assert len(bm.block_tables(seq.seq_id)[0]) == 3 and len(set(bm.block_tables(seq.seq_id)[0])) == 3
    assert len(bm.block_tables(seq.seq_id)[0]) * BS - seq.num_tokens <= BS - 1
    assert seq.num_computed_tokens == 0
    bm.check([seq])
    bm.free(seq)
    assert bm.num_available_pages == 8 and bm.block_tables(seq.seq_id) == ()
    bm.check([])


def test_append_slot_grows_only_at_block_boundaries(bm):
    seq = make_seq(range(4))
    allocate(bm, seq)
    assert len(bm.block_tables(seq.seq_id)[0]) == 1
    seq.token_ids.append(4)  # 5 tokens: needs a second block
    assert bm.append_slot(seq) and len(bm.block_tables(seq.seq_id)[0]) == 2
    for t in range(5, 8):  # 6, 7, 8 tokens: still two blocks
        seq.token_ids.append(t)
        assert bm.append_slot(seq) and len(bm.block_tables(seq.seq_id)[0]) == 2
    bm.check([seq])


def test_allocation_fails_without_side_effects_when_pool_is_short(bm):
    big = make_seq(range(33))  # 9 blocks > 8
    assert not allocate(bm, big)
    assert bm.block_tables(big.seq_id) == () and bm.num_available_pages == 8
    bm.check([])


def test_shared_prefix_refcounts_without_copy(bm):
    a = make_seq(list(range(12)) + [99], 0)
    assert allocate(bm, a)
    computed(bm, a)
    b = make_seq(list(range(12)) + [77, 78], 1)
    assert allocate(bm, b)
    assert b.num_computed_tokens == 12 and bm.block_tables(b.seq_id)[0][:3] == bm.block_tables(a.seq_id)[0][:3]
    assert bm.block_tables(b.seq_id)[0][3] != bm.block_tables(a.seq_id)[0][3]
    assert [bm.groups[0].ref_counts[x] for x in bm.block_tables(a.seq_id)[0][:3]] == [2, 2, 2]
    bm.check([a, b])
    bm.free(a)
    assert [bm.groups[0].ref_counts[x] for x in bm.block_tables(b.seq_id)[0][:3]] == [1, 1, 1]
    bm.check([b])
    bm.free(b)
    assert bm.num_cached_pages == 4  # the shared prefix stays reusable, and a's tail (token 99)
    bm.check([])


def test_hit_leaves_at_least_one_token_to_compute(bm):
    a = make_seq(range(8))
    allocate(bm, a)
    computed(bm, a)
    bm.free(a)
    again = make_seq(range(8), 1)
    assert allocate(bm, again)
    assert again.num_computed_tokens == 4  # the second block is recomputed for the last token's logits
    bm.check([again])


def test_lru_evicts_least_recently_used_first():
    bm = KVCoordinator(num_pages=10, block_size=BS)

    def prefix(i: int, seq_id: int) -> Sequence:
        return make_seq([100 * i + t for t in range(8)] + [1], seq_id)  # 2 full blocks + 1 token

    seqs = [prefix(i, i) for i in range(3)]
    for seq in seqs:
        assert allocate(bm, seq)
        computed(bm, seq)
    for seq in seqs:  # released in order 0, 1, 2: prefix 0 is the least recently used
        bm.free(seq)
    assert bm.num_cached_pages == 9  # 2 full blocks and a 1-token tail each
    hit = prefix(0, 10)  # touching prefix 0 again makes prefix 1 the oldest
    assert allocate(bm, hit) and hit.num_computed_tokens == 8
    bm.free(hit)
    bm.check([])
    # 6 blocks: the plain free one, then the 5 least recently used: tails 0 and 1, prefix 1, tail 2
    filler = make_seq([7] * 24, 11)
    assert allocate(bm, filler)
    assert bm.num_cached_pages == 4
    bm.check([filler])
    bm.free(filler)
    hits = {}
    for i in range(3):
        seq = prefix(i, 20 + i)
        assert allocate(bm, seq)
        hits[i] = seq.num_computed_tokens
        bm.free(seq)
    assert hits == {0: 8, 1: 0, 2: 8}
    bm.check([])


def test_no_stale_hit_after_eviction_and_reuse(bm):
    a = make_seq(list(range(8)) + [1], 0)
    allocate(bm, a)
    computed(bm, a)
    bm.free(a)
    # Fill the whole pool with other content: every cached block is evicted and overwritten.
    other = make_seq([500 + t for t in range(32)], 1)
    assert allocate(bm, other)
    computed(bm, other)
    bm.check([other])
    bm.free(other)
    again = make_seq(list(range(8)) + [1], 2)
    assert allocate(bm, again)
    assert again.num_computed_tokens == 0
    bm.check([again])


def test_hash_collision_cannot_serve_wrong_tokens(bm, monkeypatch):
    import tinymlx.kv.coordinator as module

    monkeypatch.setattr(module, "chain_hash", lambda previous, tokens: 42)  # every block collides
    a = make_seq(list(range(4)) + [9], 0)
    allocate(bm, a)
    computed(bm, a)
    b = make_seq([50, 51, 52, 53, 9], 1)
    assert allocate(bm, b)
    assert b.num_computed_tokens == 0
    bm.check([a, b])


def test_prefix_caching_off_never_shares():
    bm = KVCoordinator(num_pages=8, block_size=BS, enable_prefix_caching=False)
    a = make_seq(range(9))
    allocate(bm, a)
    computed(bm, a)
    bm.free(a)
    b = make_seq(range(9), 1)
    allocate(bm, b)
    assert b.num_computed_tokens == 0 and bm.num_cached_pages == 0
    bm.check([b])


def test_check_catches_a_leak(bm):
    seq = make_seq(range(5))
    allocate(bm, seq)
    bm._tables_of[seq.seq_id][0].pop()  # a reference vanishes without a free: a leaked block
    with pytest.raises(AssertionError):
        bm.check([seq])


def test_a_freed_sequence_leaves_its_partial_block_as_a_tail(bm):
    a = computed(bm, admitted(bm, make_seq(list(range(10)), 0)))  # 2 full blocks and 2 tokens in a third
    tail_block = bm.block_tables(a.seq_id)[0][2]
    bm.free(a)
    assert bm.num_cached_pages == 3
    b = make_seq(list(range(10)) + [50, 51], 1)
    assert allocate(bm, b)
    assert b.num_computed_tokens == 10 and bm.block_tables(b.seq_id)[0][2] == tail_block
    bm.check([b])
    c = make_seq(list(range(9)) + [60, 61], 2)  # the same tail's first token: taken over, it is gone
    assert allocate(bm, c) and c.num_computed_tokens == 8
    bm.check([b, c])


def test_a_tail_is_never_its_sequences_last_token(bm):
    bm.free(computed(bm, admitted(bm, make_seq(list(range(6)), 0))))
    again = make_seq(list(range(6)), 1)  # the tail holds tokens 4 and 5; the last must be computed
    assert allocate(bm, again) and again.num_computed_tokens == 5
    bm.check([again])


def test_tails_are_evicted_like_cached_blocks_and_never_leak():
    bm = KVCoordinator(num_pages=6, block_size=BS)
    for seq_id in range(3):  # three 1-token tails after one full block each
        bm.free(computed(bm, admitted(bm, make_seq([10 * seq_id + t for t in range(5)], seq_id))))
    assert bm.num_cached_pages == 6 and bm.num_available_pages == 6
    filler = make_seq([7] * 16, 9)  # 4 blocks: the oldest cached go, the first sequence's tail first
    assert allocate(bm, filler)
    bm.check([filler])
    bm.free(filler)
    hits = []
    for seq_id in range(3):
        seq = make_seq([10 * seq_id + t for t in range(5)] + [99], 20 + seq_id)
        assert allocate(bm, seq)
        hits.append(seq.num_computed_tokens)
        bm.free(seq)
    assert hits == [0, 0, 5]
    bm.check([])


def test_every_group_takes_its_own_tail_over():
    bm = KVCoordinator(num_pages=16, block_size=BS, windows=(None, 6))
    a = computed(bm, admitted(bm, make_seq(list(range(14)), 0)))
    tails = [table[3] for table in bm.block_tables(a.seq_id)]
    bm.free(a)
    b = make_seq(list(range(14)) + [70], 1)
    assert allocate(bm, b)
    assert b.num_computed_tokens == 14 and [table[3] for table in bm.block_tables(b.seq_id)] == tails
    bm.check([b])


def test_no_tails_without_prefix_caching():
    bm = KVCoordinator(num_pages=8, block_size=BS, enable_prefix_caching=False)
    bm.free(computed(bm, admitted(bm, make_seq(list(range(3)), 0))))  # a lone partial block: index 0, no full block before
    again = make_seq(list(range(3)) + [9], 1)
    assert allocate(bm, again) and again.num_computed_tokens == 0 and bm.num_cached_pages == 0
    bm.check([again])
