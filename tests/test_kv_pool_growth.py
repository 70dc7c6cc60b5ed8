"""The KV pool's arrays grow on demand (one slab, doubling, up to the budget) and shrink when idle: memory
follows the blocks held, and nothing else changes."""

from __future__ import annotations

import pytest
from tiny_models import random_workload, run_to_completion, tiny_engine

from tinymlx import SamplingParams


def allocated_pages(engine) -> int:
    return engine.runner.kv_cache.num_allocated_pages


def test_pool_starts_at_one_slab_grows_to_the_blocks_held_and_shrinks_when_idle():
    engine = tiny_engine(num_pages=1024, enable_prefix_caching=False)
    block_bytes = engine.runner.kv_cache.nbytes // allocated_pages(engine)  # one block in every layer
    assert allocated_pages(engine) == 64  # 1/16 of the budget
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(6):
        engine.add_request(list(range(200 + i)), params, request_id=f"r{i}")
    peak = 0
    while engine.has_unfinished_requests:
        engine.step()
        engine.check()
        held = engine.kv_coordinator.pool.num_pages_reached
        assert held <= allocated_pages(engine) <= max(64, 2 * held)  # doubling: at most twice what is reached
        peak = max(peak, engine.runner.kv_cache.nbytes)
    assert peak == 512 * block_bytes  # 6 x 60 blocks held at once: 64 -> 128 -> 256 -> 512
    assert allocated_pages(engine) == 64  # idle, nothing cached: back to one slab
    assert engine.stats().kv_cache_bytes == engine.runner.kv_cache.nbytes
    assert engine.stats().kv_cache_bytes_budget == 1024 * block_bytes  # what it may grow to, allocated or not


def test_cached_blocks_keep_their_slab_and_a_grown_pool_changes_no_output():
    cached = tiny_engine(num_pages=1024)
    workload = random_workload(20, seed=6, max_arrival=2)
    grown = run_to_completion(cached, {k: list(v) for k, v in workload.items()})
    reached = cached.kv_coordinator.pool.num_pages_reached
    assert reached > 64 and allocated_pages(cached) >= reached  # the cached blocks' pages stay allocated
    preallocated = tiny_engine(num_pages=1024)
    preallocated.runner.kv_cache.ensure_pages(1024)
    assert run_to_completion(preallocated, workload) == grown


def test_a_budget_below_one_page_is_refused_naming_the_page_and_no_recurrent_slots():
    """A model without recurrent layers is told the page it needs, not about state slots it does not have."""
    with pytest.raises(ValueError, match=r"cannot hold 1 KV pages of \d+ bytes .*; raise kv_cache_bytes$") as error:
        tiny_engine(num_pages=None, kv_cache_bytes=64)
    assert "recurrent" not in str(error.value)
