"""AsyncEngine: concurrent streams, cancellation frees blocks, bad input raises in the caller."""

from __future__ import annotations

import asyncio

import pytest
from tiny_models import tiny_engine

from tinymlx import LLM, SamplingParams
from tinymlx.engine.async_engine import AsyncEngine
from tinymlx.sched.scheduler import RequestTooLargeError

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture
def engines():
    engine = tiny_engine(max_model_len=128)
    async_engine = AsyncEngine(engine)
    yield engine, async_engine
    async_engine.shutdown()


async def collect(async_engine, prompt, params=GREEDY):
    outputs = [o async for o in async_engine.generate(prompt, params)]
    return outputs


def test_concurrent_streams_match_the_synchronous_engine(engines):
    _, async_engine = engines

    async def main():
        return await asyncio.gather(*(collect(async_engine, f"prompt number {i}") for i in range(6)))

    results = asyncio.run(main())
    reference = LLM.from_engine(tiny_engine()).generate([f"prompt number {i}" for i in range(6)], GREEDY)
    for outputs, expected in zip(results, reference):
        assert outputs[-1].finished and outputs[-1].token_ids == expected.token_ids
        assert "".join(o.delta_text for o in outputs) == expected.text
    assert async_engine.stats().num_generated_tokens == 6 * 16
    async_engine.check()


def test_leaving_a_stream_early_aborts_and_frees_its_blocks(engines):
    engine, async_engine = engines

    async def main():
        long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        async for output in async_engine.generate("abort me", long):
            if len(output.token_ids) >= 3:
                break
        for _ in range(100):
            await asyncio.sleep(0.01)
            if async_engine.stats().num_pages_used == 0 and async_engine.stats().num_running == 0:
                return True
        return False

    assert asyncio.run(main())
    async_engine.check()
    assert engine.kv_coordinator.num_used_pages == 0


def test_bad_requests_raise_in_the_caller_and_others_continue(engines):
    _, async_engine = engines

    async def main():
        good = asyncio.create_task(collect(async_engine, "still served"))
        with pytest.raises(RequestTooLargeError):
            await collect(async_engine, "x" * 200)
        with pytest.raises(ValueError, match="top_p"):
            await collect(async_engine, "x", SamplingParams(top_p=1.5))
        return await good

    outputs = asyncio.run(main())
    assert outputs[-1].finished and len(outputs[-1].token_ids) == 16
