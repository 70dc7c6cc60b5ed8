"""`tinymlx serve` over real loopback HTTP, driven by the official `openai` client and by httpx.

Tiny random model (its text is noise, which is fine: what matters is that every path returns what
the engine produced, and that the engine is left with no request and no block afterwards).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from server_harness import RunningServer, slowed
from tiny_models import tiny_engine

from tinymlx.server import ServerConfig

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a poem about caches."}]


@pytest.fixture(scope="module")
def server():
    running = RunningServer(tiny_engine(num_blocks=512, max_num_batched_tokens=256))
    yield running
    running.close()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def streamed_chat(client, server, **kwargs) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(model=server.model, messages=CHAT, stream=True, **kwargs))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def test_chat_streamed_and_not_give_the_same_text_and_usage(client, server):
    reply = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=24, temperature=0)
    text, chunks = streamed_chat(client, server, max_tokens=24, temperature=0, stream_options={"include_usage": True})
    choice = reply.choices[0]
    assert text == choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 24
    expected_prompt = len(server.engine.tokenizer.apply_chat_template(CHAT))
    assert reply.usage.prompt_tokens == expected_prompt and reply.usage.total_tokens == expected_prompt + 24
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24  # include_usage
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt, just before
    server.wait_idle()


def test_completions_streamed_and_not_with_echo_and_token_prompts(client, server):
    prompt = "The cache holds"
    reply = client.completions.create(model=server.model, prompt=prompt, max_tokens=10, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=server.model, prompt=prompt, max_tokens=10, temperature=0, stream=True))
    assert streamed == reply.choices[0].text and reply.object == "text_completion"
    token_prompt = server.engine.tokenizer.encode(prompt)
    by_tokens = client.completions.create(model=server.model, prompt=token_prompt, max_tokens=10, temperature=0)
    assert by_tokens.choices[0].text == reply.choices[0].text
    echoed = client.completions.create(model=server.model, prompt=prompt, max_tokens=10, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + reply.choices[0].text
    batch = client.completions.create(model=server.model, prompt=["one", "two"], max_tokens=4, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.usage.prompt_tokens == 6
    server.wait_idle()


def test_seeded_sampling_is_reproducible_and_seeds_matter(client, server):
    def sample(seed: int) -> str:
        return client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=16, temperature=1.0,
                                              seed=seed).choices[0].message.content

    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1
    text, _ = streamed_chat(client, server, max_tokens=16, temperature=1.0, seed=7)
    assert text == sample(7)


def test_stop_strings_end_the_reply_before_them(client, server):
    full = client.completions.create(model=server.model, prompt="stop here", max_tokens=24, temperature=0)
    text = full.choices[0].text
    stop = text[8:11]
    assert stop and stop in text
    cut = client.completions.create(model=server.model, prompt="stop here", max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.index(stop)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=server.model, prompt="stop here", max_tokens=24, temperature=0, stop=[stop], stream=True))
    assert streamed == cut.choices[0].text


def test_n_choices_share_the_prompt_through_the_prefix_cache(client, server):
    prompt = [{"role": "user", "content": "n choices: " + "a shared prompt " * 8}]
    computed = server.engine.num_computed_prompt_tokens
    reply = client.chat.completions.create(model=server.model, messages=prompt, n=3, max_tokens=8, temperature=1.0,
                                           seed=11)
    num_prompt = reply.usage.prompt_tokens
    assert [c.index for c in reply.choices] == [0, 1, 2] and reply.usage.completion_tokens == 24
    assert len({c.message.content for c in reply.choices}) > 1  # each choice has its own seed
    block = server.engine.config.block_size
    # The prompt's full blocks were computed once: the other two choices recomputed only their tail.
    assert server.engine.num_computed_prompt_tokens - computed <= num_prompt + 2 * (num_prompt % block + block)
    again = client.chat.completions.create(model=server.model, messages=prompt, n=3, max_tokens=8, temperature=1.0,
                                           seed=11)
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]
    server.wait_idle()


def test_logprobs_in_both_formats(client, server):
    chat = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 6 and "".join(t.token for t in content) == chat.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 3 and token.top_logprobs[0].logprob == pytest.approx(token.logprob)
    completion = client.completions.create(model=server.model, prompt="abc", max_tokens=5, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == 5 and all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list().data] == [server.model]
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    metrics = httpx.get(f"{server.base_url}/metrics").text
    for name in ("tinymlx_requests_total", "tinymlx_rejections_total", "tinymlx_queue_depth",
                 "tinymlx_queue_wait_seconds_bucket", "tinymlx_time_to_first_token_seconds_bucket",
                 "tinymlx_inter_token_latency_seconds_bucket", "tinymlx_batch_sequences_bucket",
                 "tinymlx_batch_tokens_bucket", 'tinymlx_kv_blocks{state="free"}', "tinymlx_prefix_hit_rate",
                 "tinymlx_preemptions_total"):
        assert name in metrics, name


BAD_REQUESTS = [  # (endpoint, body or raw bytes, status, param, words in the message)
    ("chat", b"{not json", 400, None, "not valid JSON"),
    ("chat", b"[1, 2]", 400, None, "JSON object"),
    ("chat", {"model": "M"}, 400, "messages", "Field required"),
    ("chat", {"model": "M", "messages": []}, 400, "messages", "at least 1"),
    ("chat", {"model": "M", "messages": CHAT, "temperature": "hot"}, 400, "temperature", "valid number"),
    ("chat", {"model": "M", "messages": CHAT, "max_tokens": "10"}, 400, "max_tokens", "valid integer"),
    ("chat", {"model": "gpt-9", "messages": CHAT}, 404, "model", "does not exist"),
    ("chat", {"model": "M", "messages": CHAT, "top_p": 0}, 400, "top_p", "(0, 1]"),
    ("chat", {"model": "M", "messages": CHAT, "temperature": -1}, 400, "temperature", "[0, inf)"),
    ("chat", {"model": "M", "messages": CHAT, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("chat", {"model": "M", "messages": CHAT, "n": 0}, 400, "n", "between 1 and 16"),
    ("chat", {"model": "M", "messages": CHAT, "presence_penalty": 3}, 400, "presence_penalty", "[-2, 2]"),
    ("chat", {"model": "M", "messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs", "logprobs"),
    ("chat", {"model": "M", "messages": CHAT, "logprobs": True, "top_logprobs": 99}, 400, "logprobs", "[0, 20]"),
    ("chat", {"model": "M", "messages": CHAT, "max_tokens": 5000}, 400, "messages", "maximum context"),
    ("chat", {"model": "M", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "robot"),
    ("chat", {"model": "M", "messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools", "not supported"),
    ("chat", {"model": "M", "messages": CHAT, "response_format": {"type": "json_object"}}, 400,
     "response_format", "not supported"),
    ("chat", {"model": "M", "messages": CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream"),
    ("chat", {"model": "M", "messages": CHAT, "seed": -1}, 400, "seed", "2**64"),
    ("chat", {"model": "M", "messages": CHAT, "logit_bias": {"5": 1.0}}, 400, "logit_bias", "not supported"),
    ("completion", {"model": "M"}, 400, "prompt", "Field required"),
    ("completion", {"model": "M", "prompt": "x" * 2000}, 400, "prompt", "maximum context"),
    ("completion", {"model": "M", "prompt": [5, 100000]}, 400, "prompt", "token ids"),
    ("completion", {"model": "M", "prompt": "x", "logprobs": 50}, 400, "logprobs", "[0, 20]"),
    ("completion", {"model": "M", "prompt": "x", "suffix": "y"}, 400, "suffix", "not supported"),
    ("completion", {"model": "M", "prompt": "x", "stop": [""]}, 400, "stop", "non-empty"),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "param", "words"), BAD_REQUESTS)
def test_bad_input_gets_the_right_status_and_a_message_naming_the_field(server, endpoint, body, status, param,
                                                                        words):
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    if isinstance(body, dict):
        body = json.dumps({**body, "model": server.model if body.get("model") == "M" else body.get("model")})
    response = httpx.post(f"{server.base_url}{path}", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
    ok = httpx.post(f"{server.base_url}/v1/completions", json={"model": server.model, "prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200  # and the server keeps serving


def test_64_concurrent_streams_equal_their_non_streamed_twins():
    running = RunningServer(slowed(tiny_engine(num_blocks=1024, max_num_batched_tokens=512), 0.002))
    try:
        client = openai.AsyncOpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)

        async def one(i: int, stream: bool) -> str:
            messages = [{"role": "user", "content": f"request {i}: " + "word " * (i % 7)}]
            kwargs = dict(model=running.model, messages=messages, max_tokens=8 + i % 9, temperature=0.8, seed=i)
            if not stream:
                return (await client.chat.completions.create(**kwargs)).choices[0].message.content
            text = ""
            async for chunk in await client.chat.completions.create(stream=True, **kwargs):
                text += chunk.choices[0].delta.content or "" if chunk.choices else ""
            return text

        async def everything():
            streamed = await asyncio.gather(*(one(i, True) for i in range(64)))
            plain = await asyncio.gather(*(one(i, False) for i in range(64)))
            return streamed, plain

        streamed, plain = asyncio.run(everything())
        assert streamed == plain and all(streamed)
        assert running.server.async_engine.stats().num_running == 0
        running.wait_idle()
    finally:
        running.close()


def test_a_burst_past_the_queue_limit_gets_503s_and_the_metrics_count_them_exactly():
    running = RunningServer(slowed(tiny_engine(num_blocks=512, max_num_seqs=2), 0.01), ServerConfig(max_queue=4))
    try:
        async def burst():
            async with httpx.AsyncClient(base_url=running.base_url, timeout=60) as http:
                body = {"model": running.model, "prompt": "burst", "max_tokens": 12}
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(20)))

        responses = asyncio.run(burst())
        refused = [r for r in responses if r.status_code == 503]
        served = [r for r in responses if r.status_code == 200]
        assert refused and served and len(refused) + len(served) == 20
        for r in refused:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full"
        assert all(len(r.json()["choices"][0]["text"]) > 0 for r in served)
        metrics = httpx.get(f"{running.base_url}/metrics").text
        assert f'tinymlx_rejections_total{{reason="queue_full"}} {len(refused)}.0' in metrics
        assert f'tinymlx_requests_total{{endpoint="completion",outcome="rejected"}} {len(refused)}.0' in metrics
        assert f'tinymlx_requests_total{{endpoint="completion",outcome="success"}} {len(served)}.0' in metrics
        running.wait_idle()
    finally:
        running.close()


def test_kv_full_is_refused_until_blocks_free():
    running = RunningServer(slowed(tiny_engine(num_blocks=24, max_num_seqs=8), 0.01), ServerConfig(max_queue=64))
    try:
        async def burst():
            async with httpx.AsyncClient(base_url=running.base_url, timeout=60) as http:
                body = {"model": running.model, "prompt": "x" * 40, "max_tokens": 4}
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(8)))

        responses = asyncio.run(burst())
        codes = [r.json()["error"]["code"] for r in responses if r.status_code == 503]
        assert codes and set(codes) == {"kv_full"} and any(r.status_code == 200 for r in responses)
        running.wait_idle()
    finally:
        running.close()


def test_clients_that_disconnect_mid_stream_free_their_blocks():
    running = RunningServer(slowed(tiny_engine(num_blocks=512), 0.01))
    try:
        async def leave_early(http: httpx.AsyncClient, i: int) -> None:
            body = {"model": running.model, "prompt": f"long story {i}", "max_tokens": 500, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                lines = 0
                async for line in response.aiter_lines():
                    lines += line.startswith("data:")
                    if lines == 3:
                        return  # leaving the block closes the connection mid-stream

        async def clients():
            async with httpx.AsyncClient(base_url=running.base_url, timeout=30) as http:
                await asyncio.gather(*(leave_early(http, i) for i in range(10)))

        asyncio.run(clients())
        steps_at_close = running.engine.num_steps
        running.wait_idle(timeout_s=2.0)
        # Aborts are applied between steps, as soon as the server hears of the disconnect.
        assert running.engine.num_steps - steps_at_close <= 2
        assert running.engine.num_generated_tokens < 10 * 50
        metrics = httpx.get(f"{running.base_url}/metrics").text
        assert 'tinymlx_requests_total{endpoint="completion",outcome="cancelled"} 10.0' in metrics
    finally:
        running.close()
