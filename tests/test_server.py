"""`tinymlx serve` over real loopback HTTP, driven by the official `openai` client and by httpx.

Tiny random model (its text is noise, which is fine: what matters is that every path returns what
the engine produced, and that the engine is left with no request and no block afterwards).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
from server_harness import RunningServer, free_port, slowed
from tiny_models import save_byte_tokenizer, save_dir, tiny_engine, tiny_model

from tinymlx.cli import build_parser
from tinymlx.server import ServerConfig

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a poem about caches."}]


@pytest.fixture(scope="module")
def server():
    running = RunningServer(tiny_engine(num_pages=512, max_num_batched_tokens=256))
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
                 "tinymlx_batch_tokens_bucket", 'tinymlx_kv_pages{state="free"}', "tinymlx_prefix_hit_rate",
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
    ("chat", {"model": "M", "messages": [{"role": "user", "content": "x" * 1100}], "max_tokens": 5000}, 400,
     "messages", "leaves no room in the maximum context of 1024 tokens"),
    ("chat", {"model": "M", "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "robot"),
    ("chat", {"model": "M", "messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools", "only function tools"),
    ("chat", {"model": "M", "messages": CHAT, "response_format": {"type": "yaml"}}, 400,
     "response_format", "json_object or json_schema"),
    ("chat", {"model": "M", "messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {}}}, 400,
     "response_format", "'schema'"),
    ("chat", {"model": "M", "messages": CHAT, "response_format": {"type": "json_schema",
              "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 400, "response_format",
     "invalid json_schema constraint"),
    ("chat", {"model": "M", "messages": CHAT, "guided_regex": "(ab"}, 400, "guided_regex", "invalid regex"),
    ("chat", {"model": "M", "messages": CHAT, "guided_choice": []}, 400, "guided_choice", "non-empty"),
    ("chat", {"model": "M", "messages": CHAT, "guided_regex": "a", "guided_choice": ["a"]}, 400, "guided_regex",
     "at most one"),
    ("completion", {"model": "M", "prompt": "x", "structured_outputs": {"grammar": "start: nothing"}}, 400,
     "structured_outputs", "invalid grammar"),
    ("completion", {"model": "M", "prompt": "x", "structured_outputs": {"yaml": "x"}}, 400,
     "structured_outputs", "unsupported field"),
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


def test_structured_output_in_every_form_the_clients_send(client, server):
    """OpenAI's response_format and vLLM's guided_* / structured_outputs all constrain the reply."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
              "maximum": 9}}, "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    reply = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=200, temperature=1.0,
                                           seed=3, response_format=fmt)
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"ok", "n"} and 0 <= value["n"] <= 9 and reply.choices[0].finish_reason == "stop"
    streamed, _ = streamed_chat(client, server, max_tokens=200, temperature=1.0, seed=3, response_format=fmt)
    assert streamed == reply.choices[0].message.content

    choice = client.chat.completions.create(model=server.model, messages=CHAT, max_tokens=20,
                                            extra_body={"guided_choice": ["red", "green"]})
    assert choice.choices[0].message.content in ("red", "green")
    regex = client.completions.create(model=server.model, prompt="x", max_tokens=20,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert regex.choices[0].text.isdigit() and len(regex.choices[0].text) == 4
    server.wait_idle()


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
    running = RunningServer(slowed(tiny_engine(num_pages=1024, max_num_batched_tokens=512), 0.002))
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


def burst(running: RunningServer, body: dict, count: int) -> list[httpx.Response]:
    """`count` identical completions at once."""
    async def post_all():
        async with httpx.AsyncClient(base_url=running.base_url, timeout=60) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={**body, "model": running.model})
                                          for _ in range(count)))

    return asyncio.run(post_all())


def test_a_burst_past_the_queue_limit_gets_503s_and_the_metrics_count_them_exactly():
    running = RunningServer(slowed(tiny_engine(num_pages=512, max_num_seqs=2), 0.01), ServerConfig(max_queue=4))
    try:
        responses = burst(running, {"prompt": "burst", "max_tokens": 12, "ignore_eos": True}, 20)
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
    running = RunningServer(slowed(tiny_engine(num_pages=24, max_num_seqs=8), 0.01), ServerConfig(max_queue=64))
    try:
        body = {"prompt": "x" * 40, "max_tokens": 4}  # 11 of the 24 blocks each
        responses = burst(running, body, 8)
        codes = [r.json()["error"]["code"] for r in responses if r.status_code == 503]
        assert codes and set(codes) == {"kv_full"} and any(r.status_code == 200 for r in responses)
        assert all(r.headers["retry-after"] for r in responses if r.status_code == 503)
        running.wait_idle()
        assert burst(running, body, 1)[0].status_code == 200  # the blocks are back
    finally:
        running.close()


def test_max_tokens_past_the_context_runs_to_its_end():
    """Clients that always ask for a lot (Claude Code: 32000) get what the context leaves, each choice and
    each prompt alike, ending with "length"; a prompt that alone fills the context is a 400 naming both."""
    running = RunningServer(tiny_engine(max_model_len=64))
    try:
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)
        room = 64 - len(running.engine.tokenizer.apply_chat_template(CHAT))
        chat = dict(model=running.model, messages=CHAT, temperature=0, extra_body={"ignore_eos": True})
        reply = client.chat.completions.create(max_tokens=32000, n=2, **chat)
        assert [c.finish_reason for c in reply.choices] == ["length", "length"]
        assert reply.usage.completion_tokens == 2 * room and reply.usage.total_tokens == 64 + room
        chunks = list(client.chat.completions.create(max_completion_tokens=32000, stream=True,
                                                     stream_options={"include_usage": True}, **chat))
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == room

        text = dict(model=running.model, max_tokens=32000, temperature=0, extra_body={"ignore_eos": True})
        batch = client.completions.create(prompt=["one", "three"], **text)  # each prompt has its own room
        assert [c.finish_reason for c in batch.choices] == ["length", "length"]
        assert batch.usage.completion_tokens == (64 - 3) + (64 - 5)
        chunks = list(client.completions.create(prompt="one", stream=True, stream_options={"include_usage": True},
                                                **text))
        assert chunks[-2].choices[0].finish_reason == "length" and chunks[-1].usage.completion_tokens == 64 - 3

        long_chat = [{"role": "user", "content": "x" * 60}]
        num_long = len(running.engine.tokenizer.apply_chat_template(long_chat))
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as chat_error:
                client.chat.completions.create(model=running.model, messages=long_chat, max_tokens=32000,
                                               stream=stream)
            assert (chat_error.value.param, chat_error.value.code) == ("messages", "context_length_exceeded")
            assert chat_error.value.body["message"] == (f"the prompt ({num_long} tokens) leaves no room in the "
                                                        "maximum context of 64 tokens; shorten it")
            with pytest.raises(openai.BadRequestError, match=r"prompt \(64 tokens\) leaves no room") as text_error:
                client.completions.create(prompt="x" * 64, stream=stream, **text)
            assert (text_error.value.param, text_error.value.code) == ("prompt", "context_length_exceeded")
        running.wait_idle()
    finally:
        running.close()


def test_a_huge_max_tokens_is_served_from_a_small_pool():
    """A pool smaller than the context (96 tokens here, the context 1024): a huge max_tokens gets what the
    pool can hold, no 400 for the pool and no 503, and admission reserves only the prompt's blocks."""
    running = RunningServer(tiny_engine(num_pages=24, max_num_seqs=8))
    try:
        body = {"model": running.model, "prompt": "x" * 40, "max_tokens": 32000, "ignore_eos": True}
        reply = httpx.post(f"{running.base_url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        assert reply.json()["usage"]["completion_tokens"] == 24 * 4 - 40
        streamed = httpx.post(f"{running.base_url}/v1/completions", timeout=60,
                              json={**body, "stream": True, "stream_options": {"include_usage": True}})
        events = [json.loads(line[5:]) for line in streamed.text.splitlines()
                  if line.startswith("data:") and "[DONE]" not in line]
        assert streamed.status_code == 200 and events[-1]["usage"]["completion_tokens"] == 24 * 4 - 40
        running.wait_idle()
        assert running.server.admission.num_reserved_blocks == 0 and running.server.admission.num_queued == 0
        too_long = httpx.post(f"{running.base_url}/v1/completions", json={**body, "prompt": "x" * 96})
        assert too_long.status_code == 400 and "whole pool has 24" in too_long.json()["error"]["message"]
    finally:
        running.close()


def test_clients_that_disconnect_mid_stream_free_their_blocks():
    running = RunningServer(slowed(tiny_engine(num_pages=512), 0.01))
    try:
        async def leave_early(http: httpx.AsyncClient, i: int) -> None:
            body = {"model": running.model, "prompt": f"long story {i}", "max_tokens": 500, "stream": True,
                    "ignore_eos": True}
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


def test_fair_policy_serves_a_quiet_tenant_ahead_of_a_flooding_one():
    """One seat; tenant "flood" queues 8 requests, then tenant "quiet" sends 2 of the same size.
    Weighted fair queuing admits the tenant with the least service (computed tokens) first, so the
    quiet tenant never waits behind the flood's backlog: its k-th request ends after at most k flood
    requests (the one running when it arrived, then one per quiet request as service evens out).
    Under fcfs both wait for every flood request."""
    def finish_order(policy: str) -> list[str]:
        engine = slowed(tiny_engine(num_pages=256, max_num_seqs=1, scheduling_policy=policy), 0.005)
        running = RunningServer(engine)
        try:
            order: list[str] = []

            async def ask(http: httpx.AsyncClient, user: str) -> None:
                body = {"model": running.model, "prompt": f"{user} asks", "max_tokens": 10, "user": user,
                        "ignore_eos": True}  # every request the same size
                assert (await http.post("/v1/completions", json=body)).status_code == 200
                order.append(user)

            async def scenario():
                async with httpx.AsyncClient(base_url=running.base_url, timeout=60) as http:
                    flood = [asyncio.create_task(ask(http, "flood")) for _ in range(8)]
                    while running.server.async_engine.stats().num_waiting < 7:
                        await asyncio.sleep(0.005)
                    order.append("quiet arrives")
                    await asyncio.gather(*flood, ask(http, "quiet"), ask(http, "quiet"))

            asyncio.run(scenario())
            running.wait_idle()
            return order
        finally:
            running.close()

    fair = finish_order("fair")
    after = fair[fair.index("quiet arrives") + 1:]
    quiet_positions = [i for i, user in enumerate(after) if user == "quiet"]
    assert quiet_positions[0] <= 1 and quiet_positions[1] <= 3, fair
    fcfs = finish_order("fcfs")
    assert fcfs[-2:] == ["quiet", "quiet"], fcfs


def test_priority_field_orders_the_queue_under_the_priority_policy():
    engine = slowed(tiny_engine(num_pages=256, max_num_seqs=1, scheduling_policy="priority"), 0.005)
    running = RunningServer(engine)
    try:
        order: list[int] = []

        async def ask(http: httpx.AsyncClient, priority: int, max_tokens: int = 8) -> None:
            body = {"model": running.model, "prompt": "p", "max_tokens": max_tokens, "priority": priority,
                    "ignore_eos": True}
            assert (await http.post("/v1/completions", json=body)).status_code == 200
            order.append(priority)

        async def scenario():
            async with httpx.AsyncClient(base_url=running.base_url, timeout=60) as http:
                first = asyncio.create_task(ask(http, 5, max_tokens=100))  # long enough for the rest to queue
                while running.server.async_engine.stats().num_running < 1:
                    await asyncio.sleep(0.002)
                await asyncio.gather(first, *(ask(http, p) for p in (3, 9, -1, 7)))

        asyncio.run(scenario())
        assert order == [5, -1, 3, 7, 9]
    finally:
        running.close()


def test_api_key_guards_every_endpoint_but_health():
    running = RunningServer(tiny_engine(), ServerConfig(api_key="s3cret"))
    try:
        assert httpx.get(f"{running.base_url}/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            denied = httpx.get(f"{running.base_url}{path}")
            assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
        wrong = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model=running.model, prompt="x", max_tokens=2)
        right = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="s3cret", max_retries=0)
        # ignore_eos: the random model may sample its end token first, and the test is about the key
        allowed = right.completions.create(model=running.model, prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
        assert allowed.usage.completion_tokens == 2
    finally:
        running.close()


def test_queue_and_request_timeouts_end_requests_with_a_clear_error():
    config = ServerConfig(queue_timeout_s=0.3, request_timeout_s=2.0)  # a 500-token reply takes over 5 s
    running = RunningServer(slowed(tiny_engine(num_pages=256, max_num_seqs=1), 0.01), config)
    try:
        async def scenario():
            async with httpx.AsyncClient(base_url=running.base_url, timeout=30) as http:
                long = {"model": running.model, "prompt": "long", "max_tokens": 500, "ignore_eos": True}
                first = asyncio.create_task(http.post("/v1/completions", json=long))
                while running.server.async_engine.stats().num_running < 1:
                    await asyncio.sleep(0.002)
                queued = await http.post("/v1/completions", json={**long, "max_tokens": 4})
                return await first, queued

        too_long, queued = asyncio.run(scenario())
        assert queued.status_code == 503 and queued.json()["error"]["code"] == "queue_timeout"
        assert queued.headers["retry-after"] == "1"
        assert too_long.status_code == 504 and "request timeout of 2.0 s" in too_long.json()["error"]["message"]
        with httpx.stream("POST", f"{running.base_url}/v1/completions", timeout=30,
                          json={"model": running.model, "prompt": "long", "max_tokens": 500, "stream": True,
                                "ignore_eos": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        assert json.loads(events[-2][5:])["error"]["code"] == "request_timeout" and events[-1] == "data: [DONE]"
        running.wait_idle()
    finally:
        running.close()


def test_a_dead_step_loop_fails_health_and_ends_streams_with_an_error_event():
    engine = slowed(tiny_engine(num_pages=256), 0.005)
    step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 20:
            raise RuntimeError("simulated device failure")
        return step()

    engine.step = failing_step
    running = RunningServer(engine)
    try:
        with httpx.stream("POST", f"{running.base_url}/v1/completions", timeout=30,
                          json={"model": running.model, "prompt": "x", "max_tokens": 200, "stream": True,
                                "ignore_eos": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data:")]
        error = json.loads(events[-2][5:])["error"]
        assert "simulated device failure" in error["message"] and events[-1] == "data: [DONE]"
        health = httpx.get(f"{running.base_url}/health")
        assert health.status_code == 503 and "died" in health.json()["reason"]
        refused = httpx.post(f"{running.base_url}/v1/completions", json={"model": running.model, "prompt": "x"})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
    finally:
        running.close()


def test_one_log_line_and_one_trace_per_request(caplog):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tinymlx.server.tracing import RequestTracer

    running = RunningServer(tiny_engine(num_pages=256))
    exporter = InMemorySpanExporter()
    running.server.runner.tracer = RequestTracer(exporter=exporter)
    try:
        with caplog.at_level("INFO", logger="tinymlx.server"):
            reply = httpx.post(f"{running.base_url}/v1/chat/completions", json={
                "model": running.model, "messages": CHAT, "max_tokens": 5, "user": "ada", "ignore_eos": True}).json()
            refused = httpx.post(f"{running.base_url}/v1/chat/completions", json={
                "model": running.model, "messages": CHAT, "max_tokens": 5, "top_p": 2})
        lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "tinymlx.server"]
        assert len(lines) == 2
        line, refused_line = lines
        assert line["request_id"] == reply["id"] and line["outcome"] == "success" and line["user"] == "ada"
        assert "error" not in line  # the refused one says why, as its client was told
        assert (refused_line["status"], refused_line["outcome"]) == (400, "invalid")
        assert refused_line["error"] == refused.json()["error"]["message"] and "top_p" in refused_line["error"]
        assert line["prompt_tokens"] == reply["usage"]["prompt_tokens"] and line["output_tokens"] == 5
        assert 0 <= line["queue_s"] <= line["ttft_s"] <= line["duration_s"]
        running.server.runner.tracer.flush()
        spans = {span.name.split()[0]: span for span in exporter.get_finished_spans()}
        assert set(spans) == {"chat", "admission", "queue_wait", "prefill", "decode"}
        root = spans.pop("chat")
        assert all(span.parent.span_id == root.context.span_id for span in spans.values())
        stages = [spans[name] for name in ("admission", "queue_wait", "prefill", "decode")]
        assert all(a.end_time <= b.start_time + 1000 for a, b in zip(stages, stages[1:]))  # in order (1 us slack)
        assert root.start_time <= stages[0].start_time and stages[-1].end_time <= root.end_time
    finally:
        running.close()


def test_sigterm_drains_in_flight_streams_and_refuses_new_requests(tmp_path):
    """`tinymlx serve` as users run it, in its own process: SIGTERM lets the stream in flight finish,
    takes no new request, and exits."""
    model_dir = save_byte_tokenizer(save_dir(tmp_path / "m", tiny_model(max_position_embeddings=4096)))
    port = free_port()
    command = [sys.executable, "-m", "tinymlx.cli", "serve", "--model", str(model_dir), "--served-model-name", "tiny",
               "--port", str(port), "--block-size", "4", "--num-pages", "1100", "--drain-timeout", "60"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None and time.monotonic() < deadline, "the server did not start"
            with contextlib.suppress(httpx.ConnectError):
                if httpx.get(f"{base}/health").status_code == 200:
                    break
            time.sleep(0.1)
        body = {"model": "tiny", "prompt": "x", "max_tokens": 4000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = [next(lines) for _ in range(4)]
            process.send_signal(signal.SIGTERM)
            while True:  # wait until the server has heard the signal
                try:
                    if httpx.get(f"{base}/health", timeout=1).json()["status"] == "draining":
                        break
                # Or it already closes its connections: a fast machine drains the stream before the poll.
                except (httpx.ConnectError, httpx.ReadTimeout, httpx.RemoteProtocolError):
                    break
            try:
                late = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "late"}, timeout=5)
                assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
            except (httpx.ConnectError, httpx.RemoteProtocolError):
                pass  # or the listening socket is already closed: refused either way
            rest = [line for line in lines if line.startswith("data:")]
        events = [json.loads(line[5:]) for line in first + rest if line.startswith("data:") and "[DONE]" not in line]
        assert rest[-1] == "data: [DONE]" and events[-1]["choices"][0]["finish_reason"] == "length"
        assert len("".join(e["choices"][0]["text"] for e in events)) > 0
        # Drained and stopped; uvicorn re-raises the signal once done, so the status names it.
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
    finally:
        process.kill()


def test_served_model_names_are_the_name_and_its_aliases():
    """`--served-model-name tiny claude-sonnet-4-5`, as vLLM: /v1/models lists both, every API serves both
    (replies carry the first), and any other name is a 404 naming what is served."""
    assert build_parser().parse_args(["serve", "--served-model-name", "tiny", "alias"]).served_model_name == [
        "tiny", "alias"]
    running = RunningServer(tiny_engine(), ServerConfig(served_model_names=("tiny", "claude-sonnet-4-5")))
    try:
        base = running.base_url
        assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == ["tiny", "claude-sonnet-4-5"]
        for name in ("tiny", "claude-sonnet-4-5"):
            chat = httpx.post(f"{base}/v1/chat/completions", json={"model": name, "messages": CHAT, "max_tokens": 2})
            assert chat.status_code == 200 and chat.json()["model"] == "tiny"
            message = httpx.post(f"{base}/v1/messages", json={"model": name, "max_tokens": 2, "messages": CHAT[1:]})
            assert message.status_code == 200 and message.json()["model"] == "tiny"
            count = httpx.post(f"{base}/v1/messages/count_tokens", json={"model": name, "messages": CHAT[1:]})
            assert count.status_code == 200 and count.json()["input_tokens"] > 0
            response = httpx.post(f"{base}/v1/responses", json={"model": name, "input": "hi", "max_output_tokens": 2})
            assert response.status_code == 200 and response.json()["model"] == "tiny"
        for path, body in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/messages/count_tokens",
                                                                          {"messages": CHAT[1:]})):
            missing = httpx.post(f"{base}{path}", json={"model": "gpt-4o", "max_tokens": 2, **body})
            assert missing.status_code == 404
            assert "this server serves 'tiny' or 'claude-sonnet-4-5'" in json.dumps(missing.json())
        running.wait_idle()
    finally:
        running.close()
