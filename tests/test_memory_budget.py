"""One budget holds every pool: `kv_cache_bytes` covers the KV pages, the recurrent state slots and a draft
model's or MTP head's pool (as many pages as the target's), and `stats()` counts every model and pool the
engine holds, to the byte MLX reports."""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest
from hybrid_checkpoints import hf_checkpoint
from mlx.utils import tree_flatten
from test_mtp import add_mtp_weights
from tiny_models import ByteTokenizer, run_outputs, tiny_model

from tinymlx import Engine, EngineConfig, SamplingParams
from tinymlx.core.step_memory import StepActivations, StepShape, activation_bytes
from tinymlx.models import load_model, load_mtp_head

MiB = 1 << 20


def workload(n: int = 6, seed: int = 0) -> dict[int, list[tuple]]:
    """Prompts that repeat themselves (drafts get kept), arriving over a few steps."""
    rng = np.random.default_rng(seed)
    arrivals: dict[int, list[tuple]] = {}
    for i in range(n):
        prompt = rng.integers(0, 256, int(rng.integers(4, 12))).tolist() * int(rng.integers(2, 5))
        params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(8, 30)), ignore_eos=True)
        arrivals.setdefault(int(rng.integers(0, 3)), []).append((prompt, params, f"r{i}"))
    return arrivals


def run_checked(engine: Engine, arrivals: dict[int, list[tuple]]) -> dict[str, list[int]]:
    """Run to the end, checking after every step that the pools stay within their budget and that nothing
    leaks (`check()`); each request's tokens."""
    tokens, budget = {}, engine.stats().pools_bytes_budget
    for step in range(10_000):
        for prompt, params, request_id in arrivals.get(step, []):
            engine.add_request(prompt, params, request_id=request_id)
        for out in engine.step():
            tokens[out.request_id] = list(out.token_ids)
        assert engine.stats().pools_bytes <= budget
        engine.check()
        if step > max(arrivals) and not engine.has_unfinished_requests:
            return tokens
    raise AssertionError("the workload did not finish")


def own_bytes(model, besides=None) -> int:
    shared = {id(a) for _, a in tree_flatten(besides.parameters())} if besides is not None else set()
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()) if id(a) not in shared)


def test_a_draft_models_pool_is_inside_the_budget_and_every_byte_is_counted():
    budget = 4 * MiB
    gc.collect()  # earlier tests' garbage must not be freed while this one counts
    mx.synchronize()
    before = mx.get_active_memory()
    target = tiny_model(0, hidden_size=256, intermediate_size=512)
    draft = tiny_model(5, hidden_size=256, intermediate_size=512)
    engine = Engine(target, ByteTokenizer(), EngineConfig(kv_cache_bytes=budget, block_size=4,
                                                          speculative="draft:other,adaptive=0"), draft_model=draft)
    stats = engine.stats()
    # Same shapes: the draft's pool takes half the budget, page for page beside the target's.
    assert stats.draft_kv_cache_bytes_budget == stats.kv_cache_bytes_budget > 0
    assert stats.pools_bytes_budget <= budget < stats.pools_bytes_budget + 2 * stats.kv_cache_bytes_budget // \
        stats.num_pages_total  # no more than a page of each left over
    alone = Engine(tiny_model(0, hidden_size=256, intermediate_size=512), ByteTokenizer(),
                   EngineConfig(kv_cache_bytes=budget, block_size=4))
    assert stats.num_pages_total == alone.stats().num_pages_total // 2
    alone.close()

    run_checked(engine, workload())
    stats = engine.stats()
    assert stats.num_accepted_tokens > 0 and stats.draft_kv_cache_bytes > 0
    assert stats.draft_weights_bytes == own_bytes(draft) and stats.weights_bytes == own_bytes(target)
    del target, draft
    gc.collect()
    mx.synchronize()
    # Everything the engine holds, and nothing else this test made: MLX's count of live bytes moved by exactly it.
    assert abs(mx.get_active_memory() - before - stats.memory_bytes) < 64 * 1024
    engine.close()


def test_an_mtp_heads_pool_and_own_weights_are_inside_the_budget(tmp_path):
    pytest.importorskip("transformers")
    hf_checkpoint(tmp_path / "m", "qwen3_5_text")
    add_mtp_weights(tmp_path / "m", "hf")
    budget = 2 * MiB
    target = load_model(tmp_path / "m", dtype="float32")
    head = load_mtp_head(tmp_path / "m", target)
    engine = Engine(target, ByteTokenizer(), EngineConfig(kv_cache_bytes=budget, block_size=4, speculative="mtp",
                                                          max_num_batched_tokens=32), draft_model=head)
    run_checked(engine, workload(seed=1))
    stats = engine.stats()
    assert stats.state_slots is not None and stats.state_slots.nbytes > 0
    assert 0 < stats.draft_kv_cache_bytes <= stats.draft_kv_cache_bytes_budget
    assert stats.pools_bytes_budget <= budget
    # The head's own layers; it shares the target's embedding, which is counted once, in weights_bytes.
    assert stats.draft_weights_bytes == own_bytes(head, besides=target) < own_bytes(head)
    engine.close()


def test_a_budget_too_small_for_the_draft_beside_the_target_is_refused_up_front():
    draft = tiny_model(5)
    alone = Engine(tiny_model(0), ByteTokenizer(), EngineConfig(num_pages=8, block_size=4))
    page = alone.stats().kv_cache_bytes_budget // 8
    alone.close()
    config = EngineConfig(kv_cache_bytes=page + page // 2, block_size=4, speculative="draft:other")
    with pytest.raises(ValueError, match="draft's pool"):
        Engine(tiny_model(0), ByteTokenizer(), config, draft_model=draft)


def test_the_draft_pair_gives_the_same_tokens_inside_the_smaller_pool():
    """A budget that now holds both pools leaves the target fewer pages: preemption may come sooner, the
    tokens may not change."""
    arrivals = workload(n=8, seed=2)
    plain = run_outputs(Engine(tiny_model(0), ByteTokenizer(), EngineConfig(num_pages=256, block_size=4)),
                        {s: list(items) for s, items in arrivals.items()})
    engine = Engine(tiny_model(0), ByteTokenizer(), EngineConfig(kv_cache_bytes=96 * 1024, block_size=4,
                                                                 speculative="draft:other,adaptive=0"),
                    draft_model=tiny_model(5))
    drafted = run_checked(engine, {s: list(items) for s, items in arrivals.items()})
    assert {r: list(o.token_ids) for r, o in plain.items()} == drafted


def test_an_engine_wires_the_working_set_while_it_lives_and_gives_the_limit_back(monkeypatch):
    """As mlx-lm's `wired_limit` does around a generation, for the engine's life (a fake working set: the CPU
    reports none, and MLX's CPU backend takes the call and ignores it)."""
    from tinymlx.core import device_memory

    limits = []
    monkeypatch.setattr(device_memory, "working_set_bytes", lambda: 3 << 30)
    monkeypatch.setattr(device_memory.mx, "set_wired_limit", lambda limit: limits.append(limit) or 123)
    engine = Engine(tiny_model(0), ByteTokenizer(), EngineConfig(num_pages=16, block_size=4))
    assert limits == [3 << 30]
    engine.close()
    engine.close()
    assert limits == [3 << 30, 123]  # the limit it replaced, once


def test_what_fits_is_what_runs_without_preemption():
    """`stats().longest_context`: four requests of the length it gives for four at once all run together to
    their end with no preemption; four a block longer each cannot."""
    def engine() -> Engine:
        return Engine(tiny_model(0), ByteTokenizer(), EngineConfig(num_pages=64, block_size=4,
                                                                   max_num_batched_tokens=16))

    fits = dict(engine().stats().longest_context)
    assert fits == {1: 256, 4: 64, 16: 16}  # 64 pages of 4 tokens, full attention only

    def run(total: int) -> tuple[int, int]:
        e, prompt = engine(), 12
        params = SamplingParams(max_tokens=total - prompt, ignore_eos=True)
        for i in range(4):
            e.add_request(list(range(i, i + prompt)), params, request_id=f"r{i}")
        most_running = 0
        while e.has_unfinished_requests:
            e.step()
            e.check()
            most_running = max(most_running, e.stats().num_running)
        return most_running, e.stats().num_preemptions

    assert run(fits[4]) == (4, 0)
    most_running, preemptions = run(fits[4] + 4)
    assert preemptions > 0 or most_running < 4
    assert engine().stats().what_fits == "256 tokens alone, 64 each beside 3 others, 16 each beside 15 others"


def test_a_steps_activations_add_up_piece_by_piece_in_any_order():
    """The scheduler builds a step's estimate chunk by chunk (and a chunk's drafts beside the pieces before
    and after it, merged): the same bytes as the whole step's at once, in any order; and the estimate of one
    decode is its parts' sum (core/step_memory.py's terms)."""
    shape = StepShape(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=256, block_size=16,
                      kv_itemsize=4)
    rng = np.random.default_rng(0)
    pieces = [(int(n), int(n + rng.integers(0, 3000))) for n in rng.choice([1, 1, 1, 3, 85, 512], 24)]
    whole = activation_bytes(shape, pieces)
    one_by_one = StepActivations(shape)
    for piece in reversed(pieces):
        one_by_one = one_by_one.plus([piece])
    assert one_by_one.bytes() == whole
    for cut in (0, 5, 24):
        halves = StepActivations(shape).plus(pieces[:cut]).merged(StepActivations(shape).plus(pieces[cut:]))
        assert halves.bytes() == whole
    scores = 2 * 4 * 1 * 1 * 32 * 4 + 1 * 1 * 32  # two float32 copies of 4 heads' scores over 2 blocks, the mask
    gathered = 2 * 2 * 32 * 16 * 4
    per_token = (6 * 64 + 3 * 128 + 2 * (4 + 2 * 2) * 16) * 4
    assert activation_bytes(shape, [(1, 20)]) == scores + gathered + per_token + 256 * 4 * 4
