"""The KV pool's arrays grow on demand (one slab, doubling, up to the budget) and shrink when idle: memory
follows the blocks held, and nothing else changes."""

from __future__ import annotations

from tiny_models import random_workload, run_to_completion, tiny_engine

from tinymlx import SamplingParams


def allocated_blocks(engine) -> list[int]:
    return engine.runner.kv_cache.num_allocated_blocks


def test_pool_starts_at_one_slab_grows_to_the_blocks_held_and_shrinks_when_idle():
    engine = tiny_engine(num_blocks=1024, enable_prefix_caching=False)
    block_bytes = engine.runner.kv_cache.nbytes // allocated_blocks(engine)[0]  # one block in every layer
    assert allocated_blocks(engine) == [64, 64]  # 1/16 of the budget, in each layer
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i in range(6):
        engine.add_request(list(range(200 + i)), params, request_id=f"r{i}")
    peak = 0
    while engine.has_unfinished_requests:
        engine.step()
        engine.check()
        held = max(group.num_blocks_reached for group in engine.block_manager.groups)
        assert held <= allocated_blocks(engine)[0] <= max(64, 2 * held)  # doubling: at most twice what is reached
        peak = max(peak, engine.runner.kv_cache.nbytes)
    assert peak == 512 * block_bytes  # 6 x 60 blocks held at once: 64 -> 128 -> 256 -> 512
    assert allocated_blocks(engine) == [64, 64]  # idle, nothing cached: back to one slab
    assert engine.stats().kv_cache_bytes == engine.runner.kv_cache.nbytes
    assert engine.stats().kv_cache_bytes_budget == 1024 * block_bytes  # what it may grow to, allocated or not


def test_cached_blocks_keep_their_slab_and_a_grown_pool_changes_no_output():
    cached = tiny_engine(num_blocks=1024)
    workload = random_workload(20, seed=6, max_arrival=2)
    grown = run_to_completion(cached, {k: list(v) for k, v in workload.items()})
    reached = max(group.num_blocks_reached for group in cached.block_manager.groups)
    assert reached > 64 and allocated_blocks(cached)[0] >= reached  # the cached blocks' ids stay allocated
    preallocated = tiny_engine(num_blocks=1024)
    for layer in range(len(allocated_blocks(preallocated))):
        preallocated.runner.kv_cache.ensure_blocks(layer, 1024)
    assert run_to_completion(preallocated, workload) == grown
