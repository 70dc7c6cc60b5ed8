"""Agents against `tinymlx serve`: tool calls, the Anthropic Messages and OpenAI Responses APIs, and
the prefix cache across an agent's turns, through the official `openai` and `anthropic` clients.

The tiny random model sits behind the real Qwen2.5 tokenizer and chat template, so prompts, the
Hermes call syntax and the call grammar are the real ones; its text is noise, so calls are forced
("required" or a named tool) wherever a test needs one. The real model answers a few cases itself.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import pytest
from server_harness import RunningServer
from tiny_models import tiny_qwen_engine

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
    "metric": {"type": "boolean"}}, "required": ["city", "metric"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.",
                                           "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
SYSTEM = "You are an agent. Use the tools to answer. " * 40  # an agent's long system prompt: many full blocks


@pytest.fixture(scope="module")
def server(default_model_dir):
    running = RunningServer(tiny_qwen_engine(default_model_dir))
    yield running
    running.close()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


def check_call(name: str, arguments: str) -> dict:
    parsed = json.loads(arguments)
    jsonschema.validate(parsed, SCHEMAS[name])
    return parsed


# -- chat completions ---------------------------------------------------------------------------
@pytest.mark.parametrize("tool_choice, parallel", [
    ("required", True),
    ("required", False),  # the grammar ends the reply with the call's last token, in the same output
    ({"type": "function", "function": {"name": "get_time"}}, True)])
def test_forced_calls_validate_and_streamed_deltas_assemble_to_the_reply(client, server, tool_choice, parallel):
    body = dict(model=server.model, messages=[{"role": "user", "content": "Weather in Paris, and the time?"}],
                tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel, temperature=0, max_tokens=120)
    reply = client.chat.completions.create(**body)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call.function.name, call.function.arguments)
        assert call.id.startswith("call_")
    if isinstance(tool_choice, dict):
        assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]

    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in client.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"name": None, "arguments": "", "ids": []})
            if piece.id:
                assert call["arguments"] == "", "the call's id and name come before its arguments"
                call["ids"].append(piece.id)
                call["name"] = piece.function.name
            call["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and "<tool_call>" not in content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert all(len(c["ids"]) == 1 for c in calls.values())
    server.wait_idle()


def tool_loop_prompt_tokens(step, turns: int = 5) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) of each turn of a tool loop that `step` runs."""
    return [step(turn) for turn in range(turns)]


def assert_turns_reuse_the_previous_prompt(counts: list[tuple[int, int]]) -> None:
    for (previous, _), (prompt, cached) in zip(counts, counts[1:]):
        assert prompt > previous
        assert cached >= 0.9 * previous, counts


def test_a_chat_completions_tool_loop_reuses_each_previous_turn_from_the_prefix_cache(client, server):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris?"}]

    def step(_turn: int) -> tuple[int, int]:
        reply = client.chat.completions.create(model=server.model, messages=messages, tools=TOOLS,
                                               tool_choice="required", temperature=0, max_tokens=80)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'})
        return reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens

    assert_turns_reuse_the_previous_prompt(tool_loop_prompt_tokens(step))
    server.wait_idle()


def test_a_messages_tool_loop_reuses_each_previous_turn_from_the_prefix_cache(claude, server):
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    messages = [{"role": "user", "content": "Weather in Paris?"}]

    def step(_turn: int) -> tuple[int, int]:
        reply = claude.messages.create(model=server.model, system=SYSTEM, messages=messages, tools=tools,
                                       tool_choice={"type": "any"}, max_tokens=80, extra_body={"temperature": 0})
        assert reply.stop_reason == "tool_use"
        messages.append({"role": "assistant", "content": [block.model_dump() for block in reply.content]})
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": block.id, "content": "21 degrees"}
            for block in reply.content if block.type == "tool_use"]})
        usage = reply.usage
        return usage.input_tokens + usage.cache_read_input_tokens, usage.cache_read_input_tokens

    assert_turns_reuse_the_previous_prompt(tool_loop_prompt_tokens(step))
    server.wait_idle()


def test_a_responses_tool_loop_reuses_each_previous_turn_from_the_prefix_cache(client, server):
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    previous, new_input = None, [{"role": "user", "content": "Weather in Paris?"}]

    def step(_turn: int) -> tuple[int, int]:
        nonlocal previous, new_input
        reply = client.responses.create(model=server.model, instructions=SYSTEM, input=new_input, tools=tools,
                                        tool_choice="required", previous_response_id=previous, temperature=0,
                                        max_output_tokens=80)
        calls = [item for item in reply.output if item.type == "function_call"]
        assert calls and reply.status == "completed"
        previous = reply.id
        new_input = [{"type": "function_call_output", "call_id": call.call_id, "output": "21 degrees"}
                     for call in calls]
        return reply.usage.input_tokens, reply.usage.input_tokens_details.cached_tokens

    assert_turns_reuse_the_previous_prompt(tool_loop_prompt_tokens(step))
    server.wait_idle()


# -- bad bodies: each API's own error shape, and the server keeps serving --------------------------
BAD_TOOL = [{"type": "function", "function": {"name": "broken", "parameters": {"type": "object",
                                                                              "properties": {"x": {"type": 7}}}}}]
USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "tools": BAD_TOOL}, "tools"),
    ({"messages": USER, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": [*USER, {"role": "tool", "tool_call_id": "call_unknown", "content": "1"}], "tools": TOOLS},
     "messages[1].tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),  # "x" is no image URL
])
def test_bad_chat_bodies_get_400s_naming_the_field(server, body, param):
    reply = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": server.model, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    server.wait_idle()


MESSAGES_TOOLS = [{"name": "get_weather", "input_schema": WEATHER}]


@pytest.mark.parametrize("body", [
    {"messages": USER},  # no max_tokens
    {"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "notes"}}]}]},
    {"max_tokens": 8, "messages": USER, "tools": [{"name": "broken", "input_schema": {"type": "object",
                                                                                      "properties": {"x": {"type": 7}}}}]},
    {"max_tokens": 8, "messages": USER, "tools": MESSAGES_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
    {"max_tokens": 8, "tools": MESSAGES_TOOLS, "messages": [*USER, {"role": "assistant", "content": "ok"},
                                                            {"role": "user", "content": [
                                                                {"type": "tool_result", "tool_use_id": "toolu_x",
                                                                 "content": "1"}]}]},
])
def test_bad_messages_bodies_get_400s_in_anthropics_shape(server, body):
    reply = httpx.post(f"{server.base_url}/v1/messages", json={"model": server.model, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["type"] == "error" and reply.json()["error"]["type"] == "invalid_request_error"
    server.wait_idle()


@pytest.mark.parametrize("body, status", [
    ({"input": "hi", "previous_response_id": "resp_unknown"}, 404),
    ({"input": "hi", "tools": [{"type": "function", "name": "broken",
                                "parameters": {"type": "object", "properties": {"x": {"type": 7}}}}]}, 400),
    ({"input": "hi", "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
      "tool_choice": {"type": "function", "name": "nope"}}, 400),
    ({"input": [{"type": "function_call_output", "call_id": "call_unknown", "output": "1"}]}, 400),
])
def test_bad_responses_bodies_get_errors_in_openais_shape(server, body, status):
    reply = httpx.post(f"{server.base_url}/v1/responses", json={"model": server.model, **body})
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["message"]
    server.wait_idle()


def test_the_server_serves_after_bad_bodies_and_counts_tokens(claude, server):
    count = claude.messages.count_tokens(model=server.model, messages=USER)
    reply = claude.messages.create(model=server.model, messages=USER, max_tokens=4, extra_body={"temperature": 0})
    assert count.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert reply.usage.output_tokens == 4 and reply.stop_reason == "max_tokens"
    server.wait_idle()


# -- the real model ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_server(default_model_dir):
    from tinymlx.core.config import EngineConfig
    from tinymlx.engine.engine import Engine

    running = RunningServer(Engine.from_config(EngineConfig(model=str(default_model_dir))))
    yield running
    running.close()


CITY_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PARIS = [{"role": "user", "content": "What's the weather like in Paris right now?"}]


@pytest.mark.real_model
def test_the_real_model_calls_the_tool_it_is_asked_for_through_each_api(real_server):
    """Under "auto" (chat, messages) the model chooses to call; it writes Qwen2.5-Coder's untagged form,
    which the call grammar takes; "required" (responses) opens the call itself."""
    client = openai.OpenAI(base_url=f"{real_server.base_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=real_server.model, messages=PARIS, tools=[CITY_TOOL],
                                           tool_choice="auto", temperature=0, max_tokens=40)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    claude = anthropic.Anthropic(base_url=real_server.base_url, api_key="unused", max_retries=0)
    message = claude.messages.create(
        model=real_server.model, messages=PARIS, max_tokens=40, extra_body={"temperature": 0},
        tools=[{"name": "get_weather", "description": "Get the current weather in a city.",
                "input_schema": CITY_TOOL["function"]["parameters"]}])
    (block,) = [b for b in message.content if b.type == "tool_use"]
    assert message.stop_reason == "tool_use" and block.input == {"city": "Paris"}

    response = client.responses.create(model=real_server.model, input=PARIS, temperature=0, max_output_tokens=40,
                                       tools=[{"type": "function", **CITY_TOOL["function"]}], tool_choice="required")
    (item,) = [i for i in response.output if i.type == "function_call"]
    assert item.name == "get_weather" and json.loads(item.arguments) == {"city": "Paris"}
    # The three APIs rendered the same conversation: the later two found it in the prefix cache.
    assert message.usage.cache_read_input_tokens > 0 and response.usage.input_tokens_details.cached_tokens > 0
    real_server.wait_idle()


@pytest.mark.real_model
def test_the_real_model_answers_in_text_when_no_tool_fits(real_server):
    client = openai.OpenAI(base_url=f"{real_server.base_url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=real_server.model, messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        tools=[CITY_TOOL], temperature=0, max_tokens=40)
    choice = reply.choices[0]
    assert choice.message.tool_calls is None and choice.message.content and choice.finish_reason == "stop"
    real_server.wait_idle()


def test_serve_builds_the_grammar_vocabulary_before_the_first_tool_turn(default_model_dir):
    """`tinymlx serve` wraps the tokenizer for llguidance at start-up, off the request path: the first turn
    offering tools then finds it built, and no turn builds another."""
    from tinymlx.server import prepare_grammars

    engine = tiny_qwen_engine(default_model_dir)
    assert engine._structured is None  # built on first use otherwise
    prepare_grammars(engine).join(timeout=60)
    built = engine._structured
    assert built is not None
    running = RunningServer(engine)
    try:
        client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=running.model, messages=[{"role": "user", "content": "hi"}],
                                               tools=TOOLS, tool_choice="required", max_tokens=64, temperature=0)
        check_call(reply.choices[0].message.tool_calls[0].function.name,
                   reply.choices[0].message.tool_calls[0].function.arguments)
        assert engine.structured_output is built
    finally:
        running.close()
