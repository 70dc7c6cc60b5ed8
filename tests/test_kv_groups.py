"""KV groups through the engine: a sliding-window group's own block ids and tables in the shared pool, releasing what its window no
longer reaches, against plain attention with no cache: greedy tokens, prefix hits deeper than the window,
preemption in a small pool, aborts; the pools' sizing and what stats() reports of each group."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from tiny_models import ByteTokenizer, allocate, dense_logits, run_outputs, tiny_model

from tinymlx.core.config import EngineConfig
from tinymlx.core.request import ValidRequest
from tinymlx.core.sampling_params import SamplingParams
from tinymlx.core.sequence import Sequence
from tinymlx.engine.engine import Engine
from tinymlx.kv.coordinator import KVCoordinator
from tinymlx.kv.group_blocks import NULL_BLOCK
from tinymlx.models import FullAttention, SlidingWindow

WINDOW, BS, ATOL = 16, 4, 1e-4
GEMMA = dict(model_type="gemma3_text", sliding_window=WINDOW, sliding_window_pattern=2)  # window, full, window, ...


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=2, std=0.02, num_hidden_layers=4, **GEMMA)  # small weights: varied greedy tokens


def assert_uncached(model, prompt: list[int], tokens: list[int], logprobs) -> None:
    """The engine's greedy tokens and their top-5 logprobs equal plain attention's with no cache at all
    (each step recomputes the whole sequence, each layer with its window)."""
    assert len(tokens) == len(logprobs)
    for step, (token, token_logprobs) in enumerate(zip(tokens, logprobs)):
        reference = np.array(nn.log_softmax(dense_logits(model, prompt + tokens[:step])[-1].astype(mx.float32)))
        assert token == int(reference.argmax()), step
        for top_token, logprob in token_logprobs.top:
            assert abs(reference[top_token] - logprob) < ATOL, (step, top_token)


def run_logged(engine: Engine, arrivals: dict[int, list[tuple]]) -> dict[str, tuple[list[int], list]]:
    """{request id: (output tokens, their logprobs)}, every step checked (run_outputs)."""
    return {request_id: (o.token_ids, o.logprobs) for request_id, o in run_outputs(engine, arrivals).items()}


def engine(model, **config) -> Engine:
    config = {"block_size": BS, "num_pages": 96, "max_num_batched_tokens": 24, **config}
    return Engine(model, ByteTokenizer(), EngineConfig(**config))


def checked_steps(engine: Engine) -> list[tuple[int, int]]:
    """Check, in every step's forward, that each sequence holds no more sliding blocks than its chunk needs
    (`peak_blocks`); between steps `engine.check()` holds them to ceil(W / bs) + 1. Returns (held, bound)."""
    seen, prepare = [], engine.runner.prepare
    by_id = lambda: {s.seq_id: s for s in engine.scheduler.running}  # noqa: E731

    def checked(batch):
        running = by_id()
        for chunk in batch.chunks:
            seq = running[chunk.seq_id]
            for group, table in zip(engine.kv_coordinator.groups, engine.kv_coordinator.block_tables(seq.seq_id)):
                if group.window is not None:
                    bound = group.peak_blocks(seq.num_tokens, len(chunk.token_ids))
                    seen.append((group.held(table), bound))
                    assert group.held(table) <= bound, (chunk.seq_id, group.held(table), bound)
        return prepare(batch)

    engine.runner.prepare = checked  # every forward's inputs, overlapped or not
    return seen


def prompts(n: int, seed: int = 0, length=(40, 90)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(*length))).tolist() for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)


def test_the_layers_form_a_window_group_and_a_full_group(model):
    e = engine(model)
    assert model.layer_specs() == (SlidingWindow(WINDOW), FullAttention()) * 2
    assert e.runner.windows == (WINDOW, None)
    assert [g.window for g in e.kv_coordinator.groups] == [WINDOW, None]


def test_greedy_tokens_equal_uncached_attention_with_windows_released(model):
    """Prompts several windows long, chunked (24-token budget), batched: the same tokens as no cache at all."""
    e = engine(model)
    seen = checked_steps(e)
    requests = [(prompt, greedy(12), f"r{i}") for i, prompt in enumerate(prompts(4))]
    finals = run_logged(e, {0: requests[:2], 3: requests[2:]})
    for prompt, _, request_id in requests:
        assert_uncached(model, prompt, *finals[request_id])
    assert max(held for held, _ in seen) <= WINDOW // BS + 1 + 24 // BS + 1
    full, window = e.kv_coordinator.groups[1], e.kv_coordinator.groups[0]
    assert window.num_cached_blocks > 0 and full.num_cached_blocks > 0  # published, then released to the LRU


def test_a_long_sequence_holds_its_window_not_its_context(model):
    e = engine(model, num_pages=64)
    e.add_request(prompts(1, length=(150, 151))[0], greedy(40), request_id="long")
    bound = -(-WINDOW // BS) + 1
    while e.has_unfinished_requests:
        e.step()
        e.check()  # asserts every sliding table's bound between steps
        for seq in e.scheduler.running:
            window, full = e.kv_coordinator.block_tables(seq.seq_id)
            assert sum(b != NULL_BLOCK for b in window) <= bound
            assert len(full) == -(-seq.num_computed_tokens // BS) or len(full) == -(-seq.num_tokens // BS)
            assert window[:len(window) - bound] == (NULL_BLOCK,) * max(0, len(window) - bound)


def test_prefix_hits_deeper_than_the_window_equal_uncached(model):
    """A second request sharing a 70-token prefix (over 4 windows) resumes at its last full block: its window
    group serves only the last window's blocks there. Same tokens as an engine without prefix caching."""
    shared = prompts(1, seed=5, length=(70, 71))[0]
    first, second = shared + [1, 2, 3], shared + [9, 8, 7, 6, 5]
    cached, uncached = engine(model), engine(model, enable_prefix_caching=False)
    for e in (cached, uncached):
        checked_steps(e)
    for e in (cached, uncached):
        run_logged(e, {0: [(first, greedy(6), "a")]})
    hits_before = cached.kv_coordinator.num_hit_tokens
    hit = run_logged(cached, {0: [(second, greedy(10), "b")]})
    assert cached.kv_coordinator.num_hit_tokens - hits_before == 68 > 4 * WINDOW  # 17 blocks from the cache
    assert_uncached(model, second, *hit["b"])
    assert hit["b"][0] == run_logged(uncached, {0: [(second, greedy(10), "b")]})["b"][0]
    assert uncached.stats().prefix_hit_rate == 0


def test_a_hit_needs_the_windows_blocks_not_the_ones_before():
    """With the window group's early blocks evicted, the full group's deep hit still counts; with its last
    window's blocks evicted too, the hit falls back to where the window group can serve (here: nowhere). The
    groups share one pool and one LRU: the blocks evicted are the least recently released of either group."""
    bm = KVCoordinator(32, BS, windows=(8, None))
    window_group = bm.groups[0]
    tokens = list(range(40))
    a = Sequence(0, ValidRequest(tokens, SamplingParams(), request_id="a"))
    assert allocate(bm, a)
    bm.cache_full_blocks(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    bm.trim(a)  # the window (keys 33..40) reaches back to block 8: blocks 0-7 are released to the LRU
    assert bm.block_tables(a.seq_id)[0][:8] == (NULL_BLOCK,) * 8 and NULL_BLOCK not in bm.block_tables(a.seq_id)[1]
    bm.check([a])
    bm.free(a)
    assert window_group.num_cached_blocks == 10  # LRU, oldest first: blocks 7..0 (released first), then 9, 8

    def evict(num_blocks: int) -> None:  # take blocks until that many cached ones are gone, then give them back
        scratch: list[int] = []
        window_group.cover(scratch, (bm.pool.num_free + num_blocks) * BS)
        window_group.free(scratch)

    evict(8)
    b = Sequence(1, ValidRequest(tokens + [99], SamplingParams(), request_id="b"))
    assert allocate(bm, b)
    assert b.num_computed_tokens == 40  # all 10 blocks: the window group still has the last window's (8, 9)
    window_table = bm.block_tables(b.seq_id)[0]
    assert window_table[:8] == (NULL_BLOCK,) * 8 and NULL_BLOCK not in window_table[8:] and len(window_table) == 11
    bm.check([b])
    bm.free(b)
    evict(1)  # block 9 goes too
    assert bm.groups[1].num_cached_blocks == 10  # the full group could serve all 10 blocks
    c = Sequence(2, ValidRequest(tokens + [98], SamplingParams(), request_id="c"))
    assert allocate(bm, c, first_chunk_tokens=BS)
    assert c.num_computed_tokens == 0
    bm.check([c])


def test_preemption_in_a_small_pool_gives_the_same_tokens(model):
    requests = [(prompt, greedy(10), f"r{i}") for i, prompt in enumerate(prompts(5, seed=7, length=(40, 60)))]
    small = engine(model, num_pages=36, max_num_batched_tokens=16)
    checked_steps(small)
    finals = run_logged(small, {0: requests})
    assert small.scheduler.num_preemptions > 0
    for prompt, _, request_id in requests:
        assert_uncached(model, prompt, *finals[request_id])


def test_an_abort_mid_stream_leaks_no_block_in_any_group(model):
    e = engine(model)
    checked_steps(e)
    for i, prompt in enumerate(prompts(3, seed=9)):
        e.add_request(prompt, greedy(30), request_id=f"r{i}")
    for step in range(8):
        e.step()
        e.check()
        if step == 4:
            e.abort("r1")
    while e.has_unfinished_requests:
        e.step()
        e.check()
    for group in e.kv_coordinator.groups:
        assert group.num_used_blocks == 0


def test_the_groups_share_one_pool_sized_in_bytes(model):
    """One pool for both groups, sized from the byte budget: a page is a block of as many layers as the groups
    have in common (2 here), and each group's ids reach as far as the whole pool. stats() reports the pool,
    each group, and the bytes: the arrays allocated so far (one slab), within the budget."""
    config = EngineConfig(block_size=BS, max_num_seqs=4, max_num_batched_tokens=24, kv_cache_bytes=1 << 20)
    e = Engine(model, ByteTokenizer(), config)
    pool_block = 2 * (2 * model.args.num_key_value_heads * model.args.head_dim * BS * 4)
    assert e.config.num_pages == (1 << 20) // pool_block
    stats = e.stats()
    assert [(g.label, g.num_layers, g.num_blocks, g.cost) for g in stats.kv_groups] == [
        (f"window {WINDOW}", 2, e.config.num_pages, 1), ("full", 2, e.config.num_pages, 1)]
    assert stats.num_pages_total == e.config.num_pages
    assert stats.kv_cache_bytes_budget == e.config.num_pages * pool_block <= 1 << 20
    assert stats.kv_cache_bytes == e.runner.kv_cache.nbytes == e.config.num_pages // 16 * pool_block
    assert sum(g.nbytes for g in stats.kv_groups) == 0  # no block used or cached


def test_a_request_is_too_large_for_what_both_groups_hold_at_once(model):
    """84 tokens take 21 full-attention blocks, and the window group up to 11 during a step of 24 tokens
    ((24 + 16 - 2) // 4 + 2): 32 of the shared pool's blocks."""
    e = engine(model, num_pages=31)
    with pytest.raises(ValueError, match="needs 32 KV pages but the whole pool has 31"):
        e.add_request(list(range(70)), greedy(14))
    e.add_request(list(range(70)), greedy(10))
    assert e.max_new_tokens(70) == 10  # what the server clamps a larger max_tokens to


def test_speculation_rolls_back_every_group(model):
    """n-gram drafts over repetitive prompts: rejected drafts' blocks go back in both groups, the window
    group keeps its bound, and the tokens are still those of plain attention."""
    e = engine(model, speculative="ngram:max_draft=6,min_n=1,adaptive=0")
    checked_steps(e)
    pattern = prompts(1, seed=11, length=(9, 10))[0]
    requests = [((pattern * 8)[:60 + 7 * i], greedy(24), f"r{i}") for i in range(3)]
    finals = run_logged(e, {0: requests})
    stats = e.stats()
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0  # drafts were verified, some rejected
    for prompt, _, request_id in requests:
        assert_uncached(model, prompt, *finals[request_id])


def test_a_draft_model_with_window_layers_is_refused_clearly(model):
    """Draft-model speculation shares the target's full-attention block tables: a draft whose layers keep
    a window has no table there, and is refused at build time, naming why."""
    target = tiny_model(seed=1)
    with pytest.raises(ValueError, match="a draft with only those"):
        Engine(target, ByteTokenizer(), EngineConfig(block_size=BS, num_pages=64, speculative="draft:gemma"),
               draft_model=model)
