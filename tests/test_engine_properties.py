"""Property test: random arrivals, aborts and pool sizes never break the engine's bookkeeping."""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import ByteTokenizer, tiny_model

from tinymlx import SamplingParams
from tinymlx.core.config import EngineConfig
from tinymlx.engine.engine import Engine
from tinymlx.sched.scheduler import RequestTooLargeError

MODEL = tiny_model(seed=7)
DRAFT = tiny_model(seed=8)

request = st.tuples(
    st.integers(0, 10),  # arrival step
    st.lists(st.integers(0, 255), min_size=1, max_size=40),  # prompt
    st.integers(1, 16),  # max_tokens
    st.one_of(st.none(), st.integers(0, 12)),  # abort after this many steps, or never
    st.sampled_from([0.0, 0.0, 0.7]),  # temperature
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request, min_size=1, max_size=12),
    num_pages=st.integers(14, 48),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.sampled_from([8, 32, 128]),
    caching=st.booleans(),
    speculative=st.sampled_from([None, "ngram", "draft:self,adaptive=0", "draft:other,adaptive=0",
                                 "ngram+draft:other,adaptive=0", "ngram+draft:self"]),
)
def test_every_request_finishes_once_and_no_block_leaks(requests, num_pages, block_size, budget, caching,
                                                        speculative):
    config = EngineConfig(block_size=block_size, num_pages=num_pages, max_num_batched_tokens=budget,
                          enable_prefix_caching=caching, max_num_seqs=8, speculative=speculative)
    draft = {"draft:self,adaptive=0": MODEL, "draft:other,adaptive=0": DRAFT, "ngram+draft:other,adaptive=0": DRAFT,
             "ngram+draft:self": MODEL}.get(speculative)
    engine = Engine(MODEL, ByteTokenizer(), config, draft_model=draft)
    accepted, aborts, finished = set(), {}, {}
    step_no = 0
    while step_no <= 10 or engine.has_unfinished_requests:
        for i, (arrival, prompt, max_tokens, abort_after, temperature) in enumerate(requests):
            if arrival == step_no:
                params = SamplingParams(temperature=temperature, seed=i, max_tokens=max_tokens, ignore_eos=True)
                try:
                    engine.add_request(prompt, params, request_id=f"r{i}")
                except RequestTooLargeError:
                    continue
                accepted.add(f"r{i}")
                if abort_after is not None:
                    aborts[step_no + abort_after] = aborts.get(step_no + abort_after, []) + [f"r{i}"]
        for request_id in aborts.pop(step_no, []):
            engine.abort(request_id)
        for output in engine.step():
            if output.finished:
                assert output.request_id not in finished, "finished twice"
                finished[output.request_id] = output
            assert len(output.token_ids) <= requests[int(output.request_id[1:])][2]
        engine.check()
        step_no += 1
        assert step_no < 2000, "the engine stopped making progress"
    assert set(finished) == accepted
    for request_id, output in finished.items():
        if output.finish_reason == "length":
            assert len(output.token_ids) == requests[int(request_id[1:])][2]
        else:
            assert output.finish_reason == "abort"
    assert engine.kv_coordinator.num_used_pages == 0
    engine.check()
    if speculative is not None:  # what was never aborted came out as without speculation
        plain = Engine(MODEL, ByteTokenizer(), dataclasses.replace(config, speculative=None))
        kept = {f"r{i}" for i, r in enumerate(requests) if r[3] is None and f"r{i}" in finished}
        for request_id in sorted(kept):
            prompt, max_tokens, temperature = requests[int(request_id[1:])][1:3] + (requests[int(request_id[1:])][4],)
            params = SamplingParams(temperature=temperature, seed=int(request_id[1:]), max_tokens=max_tokens,
                                    ignore_eos=True)
            plain.add_request(prompt, params, request_id=request_id)
        while plain.has_unfinished_requests:
            for output in plain.step():
                if output.finished:
                    assert output.token_ids == finished[output.request_id].token_ids, output.request_id
