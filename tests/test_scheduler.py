"""Scheduler: token budget, iteration-level joining, chunked prefill, preemption, policies.

No model here: a fake step commits a fixed token for every chunk that samples.
"""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from tiny_models import tiny_args

from tinymlx.core.config import EngineConfig
from tinymlx.core.request import ValidRequest
from tinymlx.core.sampling_params import SamplingParams
from tinymlx.core.sequence import Sequence, SequenceStatus
from tinymlx.kv.coordinator import KVCoordinator
from tinymlx.sched.scheduler import RequestTooLargeError, Scheduler


def make_scheduler(**config) -> Scheduler:
    config.setdefault("block_size", 4)
    config.setdefault("num_pages", 64)
    resolved = EngineConfig(**config).resolve(tiny_args(), mx.float32)
    return Scheduler(resolved, KVCoordinator(resolved.num_pages, resolved.block_size))


_ids = iter(range(10**6))


def add(scheduler: Scheduler, n: int, max_tokens: int = 8, **kwargs) -> Sequence:
    seq_id = next(_ids)
    prompt = [1000 * seq_id + i for i in range(n)]  # distinct prompts: no prefix-cache sharing
    seq = Sequence(seq_id, ValidRequest(prompt, SamplingParams(max_tokens=max_tokens), request_id=f"r{seq_id}", **kwargs))
    scheduler.add(seq)
    return seq


def step(scheduler: Scheduler):
    """Schedule, 'run', commit token 7 for each sampling chunk; finish at max_tokens."""
    batch = scheduler.schedule()
    sampled = {c.seq_id: [7] for c in batch.chunks if c.needs_sample}
    by_id = {s.seq_id: s for s in scheduler.running}
    finished = {i: "length" for i in sampled if by_id[i].num_output_tokens + 1 >= by_id[i].params.max_tokens}
    scheduler.commit(batch, sampled, finished)
    scheduler.check()
    return batch


def shape(batch) -> list[tuple[int, int]]:
    return [(c.seq_id, len(c.token_ids)) for c in batch.chunks]


def test_token_budget_limits_admission_and_chunks_the_rest():
    s = make_scheduler(max_num_batched_tokens=16)
    a, b, c = add(s, 10), add(s, 10), add(s, 10)
    batch = step(s)
    assert shape(batch) == [(a.seq_id, 10), (b.seq_id, 6)] and batch.num_batched_tokens == 16
    assert c.status is SequenceStatus.WAITING
    batch = step(s)  # a decodes first, b finishes its prompt, c starts
    assert shape(batch) == [(a.seq_id, 1), (b.seq_id, 4), (c.seq_id, 10)]
    assert [ch.needs_sample for ch in batch.chunks] == [True, True, True]


def test_max_num_seqs_caps_the_running_set():
    s = make_scheduler(max_num_seqs=2)
    seqs = [add(s, 3) for _ in range(3)]
    step(s)
    assert [q.status for q in seqs] == [SequenceStatus.RUNNING] * 2 + [SequenceStatus.WAITING]


def test_new_requests_join_at_the_next_iteration_and_finished_leave_at_once():
    s = make_scheduler()
    a = add(s, 5, max_tokens=3)
    step(s)
    step(s)
    b = add(s, 6)
    batch = step(s)  # a's last token; b joins in the same step
    assert shape(batch) == [(a.seq_id, 1), (b.seq_id, 6)]
    assert a.is_finished and a.finish_reason == "length" and not s.kv_coordinator.holds_blocks(a.seq_id)
    assert shape(step(s)) == [(b.seq_id, 1)]


def test_long_prompt_is_chunked_between_decodes():
    s = make_scheduler(max_num_batched_tokens=8)
    d1, d2 = add(s, 3, max_tokens=50), add(s, 3, max_tokens=50)
    step(s)
    long = add(s, 40)
    shapes = [shape(step(s)) for _ in range(7)]
    for sh in shapes:  # every step: both decodes, then a chunk of whatever budget is left
        assert sh[:2] == [(d1.seq_id, 1), (d2.seq_id, 1)]
    assert [sh[2][1] for sh in shapes] == [6, 6, 6, 6, 6, 6, 4]
    assert long.num_output_tokens == 1


def test_preemption_requeues_the_newest_and_recomputes():
    # 6 blocks of 4: two sequences of 8 prompt tokens take 4 blocks; growth needs more.
    s = make_scheduler(num_pages=6)
    old, new = add(s, 8, max_tokens=12), add(s, 8, max_tokens=12)
    preempted = []
    while s.has_unfinished:
        batch = step(s)
        preempted += batch.preempted_seq_ids
    assert new.seq_id in preempted and old.seq_id not in preempted
    assert new.num_preemptions >= 1 and s.num_preemptions == len(preempted)
    assert old.num_output_tokens == new.num_output_tokens == 12
    assert s.kv_coordinator.num_used_pages == 0


def test_impossible_requests_are_refused_at_once():
    s = make_scheduler(num_pages=4, max_model_len=100)
    with pytest.raises(RequestTooLargeError, match="maximum context"):
        s.check_fits(95, 10)
    with pytest.raises(RequestTooLargeError, match="whole pool has 4"):
        s.check_fits(10, 10)  # 20 tokens = 5 blocks
    assert not s.has_unfinished


def test_max_new_tokens_is_what_both_the_context_and_the_pool_leave():
    roomy = make_scheduler(num_pages=64, max_model_len=100)  # 256 tokens of pool: the context binds
    assert [roomy.max_new_tokens(n) for n in (1, 60, 100, 120)] == [99, 40, 0, -20]
    small = make_scheduler(num_pages=10, max_model_len=100)  # 40 tokens of pool: the pool binds
    assert small.max_new_tokens(30) == 10
    small.check_fits(30, small.max_new_tokens(30))  # what it leaves always fits, one more never
    with pytest.raises(RequestTooLargeError, match="whole pool has 10"):
        small.check_fits(30, 11)
    # A sliding group holds a bounded number of blocks whatever the length (here 5 during a step of 8
    # tokens); the full group has the rest of the shared pool.
    assert KVCoordinator(16, 4, windows=(None, 8)).max_num_tokens(chunk_tokens=8) == 44
    assert KVCoordinator(5, 4, windows=(8,)).max_num_tokens(chunk_tokens=8) == math.inf  # only a window
    assert KVCoordinator(4, 4, windows=(8,)).max_num_tokens(chunk_tokens=8) == 16  # a pool smaller than the window


def test_a_prompt_that_leaves_no_room_is_named_alone():
    s = make_scheduler(num_pages=10, max_model_len=100)
    with pytest.raises(RequestTooLargeError,
                       match=r"^the prompt \(100 tokens\) leaves no room in the maximum context of 100 tokens"):
        s.check_fits(100, 1)
    with pytest.raises(RequestTooLargeError,
                       match=r"^the prompt \(40 tokens\) leaves no room in the KV pool: .* whole pool has 10"):
        s.check_fits(40, 1)
    s.check_fits(39, 1)


def admission_order(policy: str, specs: list[dict]) -> list[int]:
    s = make_scheduler(scheduling_policy=policy, max_num_seqs=1)
    seqs = [add(s, 2, max_tokens=1, **spec) for spec in specs]
    order = []
    while s.has_unfinished:
        for chunk in step(s).chunks:
            order.append(seqs.index(next(q for q in seqs if q.seq_id == chunk.seq_id)))
    return order


def test_fcfs_policy_admits_in_arrival_order():
    assert admission_order("fcfs", [{"priority": 5}, {"priority": 0}, {}]) == [0, 1, 2]


def test_priority_policy_admits_lowest_value_first():
    specs = [{"priority": 5}, {"priority": 0}, {"priority": 1}, {"priority": 0}]
    assert admission_order("priority", specs) == [1, 3, 2, 0]


def test_fair_policy_alternates_between_tenants():
    specs = [{"tenant": "a"}] * 4 + [{"tenant": "b"}] * 2
    assert admission_order("fair", specs) == [0, 4, 1, 5, 2, 3]
