"""One KV pool shared by every KV group (kv/block_pool.py): a long context in the full-attention group uses what
the window group does not need, blocks a group gives back (or caches) serve another group, check() holds
the pool's pages after every step, and the arrays never pass the pool's bytes.

The engine test's model has Gemma 3 270M's KV shape exactly (18 layers, 15 over a 512-token window and 3
global, one KV head of 256, float32) with tiny weights: the pool's arithmetic is the real model's.
"""

from __future__ import annotations

import numpy as np
import pytest
from tiny_models import ByteTokenizer, allocate, run_outputs, tiny_model

from tinymlx.core.config import EngineConfig
from tinymlx.core.request import ValidRequest
from tinymlx.core.sampling_params import SamplingParams
from tinymlx.core.sequence import Sequence
from tinymlx.engine.engine import Engine
from tinymlx.kv.coordinator import KVCoordinator

MIB = 1 << 20
GEMMA_270M_KV = dict(model_type="gemma3_text", num_hidden_layers=18, sliding_window=512, sliding_window_pattern=6,
                     num_attention_heads=1, num_key_value_heads=1, head_dim=256, max_position_embeddings=32768)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma_shaped():
    return tiny_model(seed=3, std=0.02, **GEMMA_270M_KV)


def test_a_4k_context_fits_64_mib_beside_16_chats(gemma_shaped):
    """The static split refused this context ("needs 251 KV blocks but the whole pool has 113"): its 3 global
    layers hold 4k tokens and its 15 window layers 512, about 40 MB of 64 MiB. With one pool it runs, and 16
    short chats then run beside it, all at once, with the same tokens as each chat served alone."""
    config = EngineConfig(block_size=16, kv_cache_bytes=64 * MIB, max_num_seqs=17)
    e = Engine(gemma_shaped, ByteTokenizer(), config)
    costs = [g.cost for g in e.kv_coordinator.groups]
    assert costs == [5, 1] and e.config.num_pages == 64 * MIB // (3 * 16 * 2 * 256 * 4)  # 682 pages of 3 layers
    rng = np.random.default_rng(0)
    long_prompt = rng.integers(1, 256, size=4000).tolist()
    chats = [rng.integers(1, 256, size=12 + i).tolist() for i in range(16)]
    e.add_request(long_prompt, greedy(8), request_id="long")
    most_running, finals, chats_added = 0, {}, False
    while e.has_unfinished_requests:
        if not chats_added and any(s.num_computed_tokens >= len(long_prompt) for s in e.scheduler.running):
            for i, chat in enumerate(chats):  # the long context is decoding: the chats join it
                e.add_request(chat, greedy(8), request_id=f"chat{i}")
            chats_added = True
        finals.update((o.request_id, o.token_ids) for o in e.step() if o.finished)
        e.check()
        assert e.runner.kv_cache.nbytes <= 64 * MIB  # the arrays follow the pages taken, the lowest first
        most_running = max(most_running, len(e.scheduler.running))
    assert most_running == 17 and e.scheduler.num_preemptions == 0 and len(finals["long"]) == 8
    assert e.kv_coordinator.num_used_pages == 0

    alone = Engine(gemma_shaped, ByteTokenizer(), EngineConfig(block_size=16, num_pages=1024))
    served = run_outputs(alone, {0: [(chat, greedy(8), f"chat{i}") for i, chat in enumerate(chats)]})
    assert {request_id: finals[request_id] for request_id in served} == {r: o.token_ids for r, o in served.items()}


def test_blocks_one_group_released_serve_another_group():
    """A window block takes 5 pages, a full-attention one 1. The blocks a's window released (cached,
    least recently used) make room for b's full-attention blocks, while a's full-attention prefix and its
    last window stay cached: c, which repeats a, still resumes at a's end. check() holds throughout."""
    bm = KVCoordinator(40, 4, windows=(8, None), costs=(5, 1))
    window, full = bm.groups
    a = Sequence(0, ValidRequest(list(range(24)), SamplingParams(), request_id="a"))
    assert allocate(bm, a)  # 6 window blocks (30 pages) and 6 full ones (6)
    assert bm.num_used_pages == 36 and bm.pool.num_free == 4
    bm.cache_full_blocks(a, 24)
    a.num_computed_tokens = 24
    bm.trim(a)  # the window reaches back to block 4: blocks 3, 2, 1, 0 are released, in that order
    bm.check([a])
    bm.free(a)  # then window blocks 5, 4, then full blocks 5..0
    bm.check([])
    assert (window.num_cached_blocks, full.num_cached_blocks, bm.num_cached_pages) == (6, 6, 36)

    b = Sequence(1, ValidRequest([100 + t for t in range(40)], SamplingParams(), request_id="b"))
    assert allocate(bm, b, first_chunk_tokens=8)  # no hit: 2 window blocks (10) and 10 full ones (10)
    bm.check([b])
    # 20 pages: the 4 free ones, then window blocks 3, 2, 1, 0 evicted (the least recently released).
    assert (window.num_cached_blocks, full.num_cached_blocks, bm.pool.num_free) == (2, 6, 4)
    assert bm.num_used_pages == 20 and full.num_used_blocks == 10
    bm.free(b)

    c = Sequence(2, ValidRequest(list(range(24)) + [7, 7, 7, 7], SamplingParams(), request_id="c"))
    assert allocate(bm, c)
    assert c.num_computed_tokens == 24  # the full group's 6 blocks and the window's last 2 (4, 5)
    bm.check([c])
