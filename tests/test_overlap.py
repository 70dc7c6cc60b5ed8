"""Overlapped steps (Engine.run_ahead) against the synchronous step: the same requests give the same outputs.

An overlapped engine schedules and launches a decode step before the last one's tokens are read, so its
outputs come a step later; every token, logprob, text, stop and finish reason must be the synchronous
engine's, and the pool must pass check() after every step, with sequences that end inside a step run
ahead, aborts while a step is in flight, preemption and prefix caching.
"""

from __future__ import annotations

import numpy as np
from tiny_models import tiny_engine

from tinymlx import SamplingParams
from tinymlx.engine.engine import Engine

STOP_IDS = tuple(range(128, 160))


def drive(engine: Engine, arrivals: dict[int, list[tuple]], aborts: dict[str, int] | None = None) -> dict:
    """Feed requests at their arrival steps and abort request r once it has streamed aborts[r] tokens;
    check() after every step. Each request's final output, and its deltas joined."""
    aborts, finals, streams, step_no = dict(aborts or {}), {}, {}, 0
    while arrivals or engine.has_unfinished_requests:
        for prompt, params, request_id in arrivals.pop(step_no, []):
            engine.add_request(prompt, params, request_id=request_id)
        for out in engine.step():
            text, ids = streams.get(out.request_id, ("", []))
            streams[out.request_id] = (text + out.delta_text, ids + out.delta_token_ids)
            if out.finished:
                assert out.request_id not in finals, "a request finished twice"
                finals[out.request_id] = out
            elif len(out.token_ids) >= aborts.get(out.request_id, np.inf):
                del aborts[out.request_id]
                engine.abort(out.request_id)
        engine.check()
        tokens = {s.request_id: s.output_token_ids for s in (*engine.scheduler.running, *engine.scheduler.waiting)}
        for request in engine.stats().requests:  # a step in flight's token is not counted before it is read
            real = [t for t in tokens.get(request.request_id, ()) if t >= 0]
            assert request.num_output_tokens == len(real), request.request_id
        step_no += 1
    assert engine.kv_coordinator.num_used_pages == 0
    return {r: (o.token_ids, o.text, o.finish_reason, o.stop_sequence, streams[r], o.metrics.num_cached_tokens,
                o.metrics.num_preemptions, o.logprobs) for r, o in finals.items()}


def assert_same(got: dict, expected: dict) -> None:
    """All equal, logprobs' values to float32 rounding: a row's logits may differ in their last bits when
    its batch holds one row more (a request that ended, or was aborted, inside a step run ahead)."""
    assert got.keys() == expected.keys()
    for request_id, (*outputs, logprobs) in got.items():
        *expected_outputs, expected_logprobs = expected[request_id]
        assert outputs == expected_outputs, request_id
        assert (logprobs is None) == (expected_logprobs is None)
        for a, b in zip(logprobs or (), expected_logprobs or (), strict=True):
            assert a.token_id == b.token_id and [i for i, _ in a.top] == [i for i, _ in b.top]
            np.testing.assert_allclose([a.logprob, *(lp for _, lp in a.top)],
                                       [b.logprob, *(lp for _, lp in b.top)], rtol=1e-5, atol=1e-5)


def both(arrivals: dict[int, list[tuple]], aborts: dict[str, int] | None = None, **config) -> tuple[dict, Engine]:
    """The outputs of a synchronous and an overlapped engine (asserted equal), and the overlapped engine,
    which must have scheduled steps ahead."""
    sync, ahead = tiny_engine(**config), tiny_engine(**config)
    sync.run_ahead.is_enabled = False
    start, ahead.num_scheduled_ahead = ahead.runner.start, 0

    def counting_start(batch, pending=None):
        ahead.num_scheduled_ahead += pending is not None
        return start(batch, pending)

    ahead.runner.start = counting_start
    copy = {step: list(items) for step, items in arrivals.items()}
    expected, got = drive(sync, arrivals, aborts), drive(ahead, copy, aborts)
    assert_same(got, expected)
    assert ahead.num_scheduled_ahead > 0
    assert ahead.scheduler.num_preemptions == sync.scheduler.num_preemptions
    return got, ahead


def workload(n: int, seed: int = 0, max_arrival: int = 6) -> dict[int, list[tuple]]:
    """Staggered requests: greedy and seeded sampling, logprobs, stop strings and ids, EOS, max_tokens."""
    rng = np.random.default_rng(seed)
    arrivals: dict[int, list[tuple]] = {}
    for i in range(n):
        prompt = rng.integers(0, 256, int(rng.integers(3, 40))).tolist()
        kind = i % 5
        params = SamplingParams(
            temperature=0.8 if kind == 1 else 0.0, seed=i if kind == 1 else None,
            max_tokens=int(rng.integers(1, 40)), ignore_eos=kind != 4,
            logprobs=2 if kind in (0, 1) else None,
            stop=("s", "W", "?", "o:") if kind == 2 else (), stop_token_ids=STOP_IDS if kind == 3 else ())
        arrivals.setdefault(int(rng.integers(0, max_arrival)), []).append((prompt, params, f"r{i}"))
    return arrivals


def test_overlapped_steps_give_the_synchronous_outputs():
    reasons = set()
    for seed in range(3):
        got, _ = both(workload(20, seed), max_num_batched_tokens=64)
        reasons |= {(out[2], out[3] is not None) for out in got.values()}
    assert reasons == {("length", False), ("stop", False), ("stop", True)}  # stop strings and tokens


def test_requests_that_stop_inside_a_step_run_ahead_match():
    """Long requests arriving together, each stopping at a token or string read one step late."""
    rng = np.random.default_rng(7)
    arrivals = {0: [(rng.integers(0, 256, 8).tolist(),
                     SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=60, logprobs=1,
                                    stop_token_ids=tuple(range(100 + 10 * i, 130 + 10 * i)), stop=("q", "Z")),
                     f"s{i}") for i in range(8)]}
    got, _ = both(arrivals)
    assert sum(out[2] == "stop" for out in got.values()) >= 6


def test_aborts_while_a_step_runs_ahead_match():
    for seed in range(2):
        aborts = {f"r{i}": 1 + 3 * i % 11 for i in range(0, 16, 2)}
        got, _ = both(workload(16, seed=seed + 3, max_arrival=4), aborts, max_num_batched_tokens=64)
        aborted = [r for r, out in got.items() if out[2] == "abort"]
        assert len(aborted) >= 3 and all(len(got[r][0]) == aborts[r] for r in aborted)


def test_preemption_in_a_small_pool_matches():
    got, ahead = both(workload(16, seed=1, max_arrival=2), num_pages=24, max_num_batched_tokens=64)
    assert ahead.scheduler.num_preemptions > 0


def test_prefix_hits_match():
    system = list(b"You are a careful assistant. Answer briefly and exactly. ")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    arrivals = {2 * i: [(system + list(f"question {i}?".encode()), params, f"q{i}")] for i in range(6)}
    got, ahead = both(arrivals)
    assert sum(out[5] for out in got.values()) > 0 and ahead.stats().prefix_hit_rate > 0.5


def test_requests_that_read_tokens_on_the_host_run_synchronously_beside_the_others():
    arrivals = workload(8, seed=4, max_arrival=3)
    arrivals[1] = arrivals.get(1, []) + [
        (list(b"penalised"), SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3,
                                            frequency_penalty=0.5, ignore_eos=True), "pen"),
        (list(b"phone: "), SamplingParams(temperature=0.7, seed=5, max_tokens=20, regex=r"\d{3}-\d{4}"), "re")]
    got, _ = both(arrivals, max_num_batched_tokens=64)
    assert got["re"][2] == "stop" and len(got["re"][1]) == 8


def test_a_lone_request_runs_no_step_for_nothing_when_its_length_is_known():
    """At max_tokens the engine reads the last token before scheduling again: as many forwards as the
    synchronous engine. A stop token is only known once read: at most one forward more."""
    for params, most_extra in ((SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), 0),
                               (SamplingParams(temperature=0, max_tokens=30, stop_token_ids=STOP_IDS), 1)):
        forwards = []
        for run_ahead in (False, True):
            engine = tiny_engine()
            engine.run_ahead.is_enabled = run_ahead
            forwards.append(0)
            for name in ("run", "start"):
                setattr(engine.runner, name, counted(getattr(engine.runner, name), forwards))
            drive(engine, {0: [(list(b"abc"), params, "a")]})
        assert 0 <= forwards[1] - forwards[0] <= most_extra


def counted(run, counts: list[int]):
    def wrapper(*args, **kwargs):
        counts[-1] += 1
        return run(*args, **kwargs)
    return wrapper
