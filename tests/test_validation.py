"""A request is validated once, at the edge: Engine.validate, whichever face it came through (LLM,
AsyncEngine, the server), and add_request queues the ValidRequest it returned without checking again."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from server_harness import RunningServer
from tiny_models import tiny_engine

from tinymlx import LLM, SamplingParams
from tinymlx.core.request import ValidRequest
from tinymlx.engine.async_engine import AsyncEngine
from tinymlx.sched.scheduler import RequestTooLargeError

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def counted(engine):
    """The engine, with every call of its validate() recorded as (number of prompt tokens, max_tokens)."""
    calls = []
    validate = engine.validate
    engine.validate = lambda token_ids, params, images=None: calls.append(
        (len(token_ids), params.max_tokens)) or validate(token_ids, params, images)
    return engine, calls


def test_llm_validates_each_prompt_once():
    engine, calls = counted(tiny_engine())
    outputs = LLM.from_engine(engine).generate(["one", "three"], PARAMS)
    assert calls == [(3, 4), (5, 4)] and [len(o.token_ids) for o in outputs] == [4, 4]
    list(LLM.from_engine(engine).stream("one", PARAMS))
    assert len(calls) == 3


def test_add_request_queues_what_validate_returned_as_it_is():
    engine, calls = counted(tiny_engine(max_model_len=64))
    valid = engine.validate([1, 2, 3], PARAMS)
    assert isinstance(valid, ValidRequest) and len(calls) == 1
    engine.add_request(valid.token_ids, valid.params, "r1", checked=valid)
    assert len(calls) == 1
    # Other ids or params than the ones it checked are checked again.
    engine.add_request(valid.token_ids, SamplingParams(max_tokens=4), "r2", checked=valid)
    engine.add_request([1, 2, 3], valid.params, "r3", checked=valid)
    assert len(calls) == 3
    with pytest.raises(RequestTooLargeError, match="maximum context of 64"):
        engine.add_request(list(range(70)), valid.params, checked=valid)
    while engine.has_unfinished_requests:
        engine.step()


def test_async_engine_validates_in_the_caller_once():
    engine, calls = counted(tiny_engine())
    async_engine = AsyncEngine(engine)

    async def main():
        return [o async for o in async_engine.generate("one", PARAMS)]

    try:
        assert asyncio.run(main())[-1].finished and calls == [(3, 4)]
    finally:
        async_engine.shutdown()


def test_the_server_validates_each_choice_once_and_answers_400_before_streaming():
    engine, calls = counted(tiny_engine(max_model_len=64))
    running = RunningServer(engine)
    try:
        body = dict(model=running.model, prompt="one", max_tokens=4, n=2, temperature=0, ignore_eos=True)
        reply = httpx.post(f"{running.base_url}/v1/completions", json=body, timeout=30)
        assert reply.status_code == 200 and len(reply.json()["choices"]) == 2
        assert calls == [(3, 4), (3, 4)]  # one per choice, none again when queued
        bad = httpx.post(f"{running.base_url}/v1/completions", timeout=30,
                         json={**body, "n": 1, "stream": True, "guided_regex": "(ab"})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_constraint"
        long = httpx.post(f"{running.base_url}/v1/completions", timeout=30,
                          json={**body, "n": 1, "stream": True, "prompt": "x" * 64})
        assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
        assert "leaves no room in the maximum context of 64 tokens" in long.json()["error"]["message"]
        running.wait_idle()
    finally:
        running.close()
