"""Engine behaviour on a tiny random model: batching, preemption and caching change nothing but speed."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from tiny_models import ByteTokenizer, random_workload, run_to_completion, tiny_engine, tiny_model

from tinymlx import LLM, SamplingParams
from tinymlx.core.config import EngineConfig
from tinymlx.engine.engine import Engine
from tinymlx.sched.scheduler import RequestTooLargeError


def sequential(arrivals, **config) -> dict[str, list[int]]:
    results = {}
    for items in arrivals.values():
        for prompt, params, request_id in items:
            results.update(run_to_completion(tiny_engine(**config), {0: [(prompt, params, request_id)]}))
    return results


def test_batched_greedy_equals_sequential():
    batched = run_to_completion(tiny_engine(max_num_batched_tokens=64), random_workload(24))
    assert batched == sequential(random_workload(24))
    assert all(len(tokens) >= 1 for tokens in batched.values())


def test_preemption_gives_identical_outputs():
    tight = tiny_engine(num_pages=24, max_num_batched_tokens=64)
    pressured = run_to_completion(tight, random_workload(16, seed=1, max_arrival=2))
    assert tight.scheduler.num_preemptions > 0
    assert pressured == run_to_completion(tiny_engine(), random_workload(16, seed=1, max_arrival=2))


def test_prefix_cache_saves_work_and_changes_no_output():
    system = list(b"You are a careful assistant. Answer briefly and exactly. ") * 2
    arrivals = {i: [(system + list(f"question {i}?".encode()), SamplingParams(temperature=0, max_tokens=8,
                                                                               ignore_eos=True), f"q{i}")]
                for i in range(8)}
    cached_engine, plain_engine = tiny_engine(), tiny_engine(enable_prefix_caching=False)
    cached = run_to_completion(cached_engine, {k: list(v) for k, v in arrivals.items()})
    plain = run_to_completion(plain_engine, arrivals)
    assert cached == plain
    saved = 1 - cached_engine.num_computed_prompt_tokens / plain_engine.num_computed_prompt_tokens
    assert saved > 0.6, saved
    assert cached_engine.stats().prefix_hit_rate > 0.6


def test_turn_two_reuses_turn_one_prompt_and_answer():
    engine = tiny_engine()
    llm = LLM.from_engine(engine)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate([list(b"<user>tell me about paged attention\n<assistant>")], params)[0]
    turn_two = first.prompt_token_ids + first.token_ids + list(b"\n<user>and prefix caching?\n<assistant>")
    second = llm.generate([turn_two], params)[0]
    # Every token turn 1 computed (all but its last sampled one), its partial last block included
    reusable = len(first.prompt_token_ids) + len(first.token_ids) - 1
    assert reusable % 4 and second.metrics.num_cached_tokens == reusable
    uncached = LLM.from_engine(tiny_engine(enable_prefix_caching=False)).generate([turn_two], params)[0]
    assert second.token_ids == uncached.token_ids
    engine.check()


def test_a_tail_serves_a_prompt_that_parts_from_it_inside_the_block():
    """A later prompt agreeing with a finished sequence's tail only on its first tokens reuses those, and
    writes its own past them: its reply matches an uncached engine's, and so does a third prompt that
    finds the tail gone (taken over) and the block rewritten."""
    engine = tiny_engine(block_size=8)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    base = list(b"0123456789abcdefghijk")  # 21 tokens: 2 full blocks and a 5-token tail once computed...
    llm = LLM.from_engine(engine)
    llm.generate([base], SamplingParams(temperature=0, max_tokens=1))  # ...computing all 21 (not the sampled one)
    parted = base[:19] + list(b"XYZ")  # agrees on 3 of the tail's 5 tokens
    again = base[:19] + list(b"QQ")
    replies = [llm.generate([prompt], params)[0] for prompt in (parted, again)]
    assert [r.metrics.num_cached_tokens for r in replies] == [19, 16]  # the tail went to the first
    uncached = LLM.from_engine(tiny_engine(block_size=8, enable_prefix_caching=False))
    assert [r.token_ids for r in replies] == [uncached.generate([p], params)[0].token_ids for p in (parted, again)]
    engine.check()


def test_abort_mid_stream_frees_blocks_within_one_step():
    engine = tiny_engine()
    keep = engine.add_request(list(range(40)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    victim = engine.add_request(list(range(50, 90)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        engine.step()
    used_before = engine.kv_coordinator.num_used_pages
    engine.abort(victim)
    engine.check()
    assert engine.kv_coordinator.num_used_pages < used_before
    outputs = {o.request_id: o for o in engine.step()}
    assert outputs[victim].finished and outputs[victim].finish_reason == "abort"
    finals = run_to_completion(engine, {})
    assert len(finals[keep]) == 20


def test_impossible_requests_fail_alone_and_lose_nothing():
    engine = tiny_engine(num_pages=32, max_model_len=200)
    good = engine.add_request(list(range(20)), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.step()
    with pytest.raises(RequestTooLargeError, match="maximum context"):
        engine.add_request(list(range(190)), SamplingParams(max_tokens=20))
    with pytest.raises(RequestTooLargeError, match="whole pool"):
        engine.add_request(list(range(100)), SamplingParams(max_tokens=50))
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request("hi", SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("", SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1, 2, 10_000], SamplingParams())
    finals = run_to_completion(engine, {})
    assert list(finals) == [good] and len(finals[good]) == 10


def test_llm_generate_validates_everything_before_queueing():
    llm = LLM.from_engine(tiny_engine(max_model_len=64))
    with pytest.raises(RequestTooLargeError):
        llm.generate(["short", "x" * 100], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests


def test_stop_conditions():
    llm = LLM.from_engine(tiny_engine())
    free = llm.generate("abc", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 30
    stop_token = free.token_ids[5]
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                             stop_token_ids=[stop_token]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: free.token_ids.index(stop_token) + 1]
    text = free.text
    stop = text[3:5]
    if stop.strip():
        out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
        assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]


def test_seeded_requests_do_not_depend_on_the_batch():
    llm = LLM.from_engine(tiny_engine())
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate("the same prompt", seeded)[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=int(n), ignore_eos=True) for n in (5, 9, 20)]
    batch = llm.generate(["x", "the same prompt", "yy", "zzz"], [others[0], seeded, others[1], others[2]])
    assert batch[1].token_ids == alone


def test_stream_deltas_add_up_and_closing_aborts():
    llm = LLM.from_engine(tiny_engine())
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    deltas = list(llm.stream("hello", params))
    assert deltas[-1].finished and "".join(d.delta_text for d in deltas) == deltas[-1].text
    assert sum(len(d.delta_token_ids) for d in deltas) == 12
    stream = llm.stream("hello", params)
    next(stream)
    stream.close()
    llm.engine.step()
    assert not llm.engine.has_unfinished_requests
    llm.engine.check()
    assert llm.engine.kv_coordinator.num_used_pages == 0


def test_stats_reflect_the_engine():
    engine = tiny_engine(num_pages=64)
    engine.add_request(list(range(30)), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.add_request(list(range(30)), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    stats = engine.stats()
    assert stats.num_pages_total == 64
    assert stats.num_pages_used + stats.num_pages_cached + stats.num_pages_free == 64
    assert stats.num_running == 2 and stats.num_batched_seqs == 2
    assert stats.num_batched_tokens == 30 + 2  # the twin hits 28 tokens in the same step
    assert stats.prefix_hit_rate == pytest.approx(28 / 60)
    assert all(r.ttft_s is not None and r.block_tables[0] for r in stats.requests)


def test_close_gives_the_memory_back_and_refuses_what_comes_after():
    """`with LLM(...)` blocks one after another hold one model at a time: close() frees the weights, the KV
    pool and the draft model's, as MLX counts its memory in use."""
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    engine = Engine(tiny_model(seed=0), ByteTokenizer(), EngineConfig(block_size=4, num_pages=1024,
                                                                      speculative="draft:other,adaptive=0"),
                    draft_model=tiny_model(seed=1))
    run_to_completion(engine, {0: [(list(range(1, 200)), SamplingParams(max_tokens=8, ignore_eos=True), "a")]})
    held = mx.get_active_memory() - before
    assert held >= engine.weights_bytes + engine.runner.kv_cache.nbytes > 0
    engine.close()
    assert mx.get_active_memory() - before < 0.02 * held
    assert engine.stats().kv_cache_bytes == 0
    with pytest.raises(RuntimeError, match="this engine is closed"):
        engine.add_request("again", SamplingParams(max_tokens=2))
    engine.close()  # a second close does nothing
