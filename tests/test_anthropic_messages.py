"""The Anthropic Messages API's wire format: parse, errors, the Message object and the event stream,
checked against the official `anthropic` client's own types and the documented event sequence.

Part 2 runs the real client over loopback against `tinymlx serve` (the tiny model behind the real
Qwen2.5 tokenizer and chat template).
"""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import Message as AnthropicMessage
from anthropic.types import RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import BaseModel, TypeAdapter

from tinymlx.server.anthropic.messages import AnthropicMessages
from tinymlx.server.served_models import ServedModels
from tinymlx.turns.api_error import APIError
from tinymlx.turns.turn import (
    ChatTurn,
    Message,
    ReasoningDelta,
    TextDelta,
    Tool,
    ToolArgumentsDelta,
    ToolCall,
    ToolCallEnd,
    ToolCallStart,
    TurnResult,
)

MODEL = "tiny-qwen2-tools"
WIRE = AnthropicMessages(ServedModels((MODEL,)))
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]},
                                            "metric": {"type": "boolean"}},
           "required": ["city", "metric"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER},
         {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}]
USER = [{"role": "user", "content": "hi"}]
STREAM_EVENT = TypeAdapter(RawMessageStreamEvent)


def parse(**body):
    return WIRE.parse({"model": MODEL, "max_tokens": 16, "messages": USER, **body})


def refused(body: dict, count: bool = False) -> APIError:
    with pytest.raises(APIError) as caught:
        (WIRE.parse_count if count else WIRE.parse)(body)
    return caught.value


def result(text="", reasoning=None, calls=(), finish="stop", stop_sequence=None) -> TurnResult:
    return TurnResult(text, reasoning, list(calls), finish, num_prompt_tokens=120, num_completion_tokens=9,
                      num_cached_tokens=96, stop_sequence=stop_sequence)


def no_extras(model: BaseModel) -> None:
    """The client's models accept unknown fields silently; a misspelt field of ours would pass."""
    assert not model.model_extra, f"{type(model).__name__} has fields the API does not define: {model.model_extra}"
    for value in model.__dict__.values():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, BaseModel):
                no_extras(item)


# -- parse: every field ---------------------------------------------------------------------------
def test_a_minimal_body_leaves_sampling_to_the_server():
    request = parse()
    assert request.model == MODEL and request.max_tokens == 16 and request.stream is False
    assert request.sampling == {} and request.constraint == {} and request.user is None
    assert request.turn == ChatTurn((Message("user", "hi"),))


def test_sampling_stream_metadata_and_output_format_are_read():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = parse(temperature=0, top_p=0.5, top_k=4, stop_sequences=["END"], stream=True,
                    metadata={"user_id": "u-1"}, output_config={"format": {"type": "json_schema", "schema": schema},
                                                                "effort": "low"},
                    service_tier="auto")  # steers Anthropic's service only: ignored
    assert request.sampling == {"temperature": 0.0, "top_p": 0.5, "top_k": 4, "stop": ["END"]}
    assert request.stream is True and request.user == "u-1"
    assert request.constraint == {"json_schema": schema}
    assert parse(output_format={"type": "json_schema", "schema": schema}).constraint == {"json_schema": schema}


def test_system_as_a_string_or_blocks_and_claude_codes_billing_header_is_dropped():
    assert parse(system="Be brief.").turn.messages[0] == Message("system", "Be brief.")
    blocks = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.37; cch=fa690;"},
              {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Use tools."}]
    assert parse(system=blocks).turn.messages[0] == Message("system", "You are an agent.\nUse tools.")
    assert parse(system="").turn.messages == (Message("user", "hi"),)


def test_a_system_message_inside_messages_stays_where_it_stands():
    """Claude Code sends its environment as a system-role message after the first user turn (#41)."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "say hi"}]},
                {"role": "system", "content": [{"type": "text", "text": "Tools: Read, Bash.",
                                                "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": "hi"}, {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "again"}]
    assert parse(system="You are an agent.", messages=messages).turn.messages == (
        Message("system", "You are an agent."), Message("user", "say hi"), Message("system", "Tools: Read, Bash."),
        Message("assistant", "hi"), Message("system", "Be brief."), Message("user", "again"))
    error = refused({"model": MODEL, "max_tokens": 4, "messages": [
        *USER, {"role": "system", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]})
    assert error.param == "messages[1].content[0].type" and "role 'system' must be text" in error.message


def test_tools_and_each_tool_choice():
    request = parse(tools=TOOLS)
    assert request.turn.tools == (Tool("get_weather", "The weather in a city.", WEATHER),
                                  Tool("get_time", "", {"type": "object", "properties": {}}))
    assert (request.turn.tool_choice, request.turn.parallel_tool_calls) == ("auto", True)
    for choice, expected in [({"type": "auto"}, ("auto", True)), ({"type": "any"}, ("required", True)),
                             ({"type": "none"}, ("none", True)), ({"type": "tool", "name": "get_time"}, ("get_time", True)),
                             ({"type": "any", "disable_parallel_tool_use": True}, ("required", False))]:
        turn = parse(tools=TOOLS, tool_choice=choice).turn
        assert (turn.tool_choice, turn.parallel_tool_calls) == expected, choice


@pytest.mark.parametrize("thinking, kwargs, expected", [
    ({"type": "enabled", "budget_tokens": 2048}, None, {"enable_thinking": True}),
    ({"type": "adaptive"}, None, {"enable_thinking": True}),
    ({"type": "disabled"}, None, {"enable_thinking": False}),
    (None, {"enable_thinking": False}, {"enable_thinking": False}),
    ({"type": "enabled", "budget_tokens": 1024}, {"enable_thinking": False, "x": 1}, {"enable_thinking": False, "x": 1}),
])
def test_thinking_and_chat_template_kwargs_become_template_kwargs(thinking, kwargs, expected):
    body = {k: v for k, v in (("thinking", thinking), ("chat_template_kwargs", kwargs)) if v is not None}
    assert parse(**body).turn.template_kwargs == expected


def test_deferred_tools_are_left_out_of_the_prompt_and_the_grammar():
    """Claude Code's DeferredToolPlaceholder ("never call this tool") is its only deferred tool."""
    placeholder = {"name": "DeferredToolPlaceholder", "description": "never call this tool",
                   "input_schema": {"type": "object", "properties": {}}, "defer_loading": True}
    turn = parse(tools=[*TOOLS, placeholder]).turn
    assert [tool.name for tool in turn.tools] == ["get_weather", "get_time"]
    assert refused({"model": MODEL, "max_tokens": 8, "messages": USER, "tools": [*TOOLS, placeholder],
                    "tool_choice": {"type": "tool", "name": "DeferredToolPlaceholder"}}).param == "tool_choice.name"


PLACEHOLDER = {"name": "DeferredToolPlaceholder", "description": "never call this tool",
               "input_schema": {"type": "object", "properties": {}}, "defer_loading": True}
SEARCH = {"name": "ToolSearch", "description": "Loads deferred tools.",
          "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}}
FETCH = {"name": "WebFetch", "description": "Fetches a URL.", "defer_loading": True,
         "input_schema": {"type": "object", "properties": {"url": {"type": "string", "enum": ["https://a.b/"]}},
                          "required": ["url"], "additionalProperties": False}}


def searched(*names: str) -> list[dict]:
    """Claude Code's ToolSearch round: the call, then its result of tool_reference blocks."""
    return [{"role": "user", "content": "Fetch https://a.b/"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "ToolSearch",
                                               "input": {"query": "select:" + ",".join(names)}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                          "content": [{"type": "tool_reference", "tool_name": n} for n in names]}]}]


def test_a_tool_reference_loads_a_deferred_tool_without_changing_the_prompts_tool_list():
    """Claude Code's ToolSearch answers with tool_reference blocks (captured from Claude Code 2.1.328 on the
    1.5B, whose first call was ToolSearch "select:Write,Edit"). A deferred tool it names becomes callable
    and its definition is the result's text; a listed tool is noted as loaded; the tool list the prompt
    renders is the one every turn had, so the turn's prefix stays cached."""
    tools = [*TOOLS, SEARCH, PLACEHOLDER, FETCH]
    turn = parse(tools=tools, messages=searched("WebFetch", "get_time")).turn
    assert [tool.name for tool in turn.tools] == ["get_weather", "get_time", "ToolSearch"]
    assert [tool.name for tool in turn.loaded_tools] == ["WebFetch"]
    result_text = turn.messages[-1].content
    assert json.loads(result_text.splitlines()[0]) == {"name": "WebFetch", "description": "Fetches a URL.",
                                                        "input_schema": FETCH["input_schema"]}
    assert result_text.splitlines()[1] == "Tool loaded: get_time"
    assert parse(tools=tools, messages=searched("WebFetch"), tool_choice={"type": "tool", "name": "WebFetch"}).turn
    unknown = refused({"model": MODEL, "max_tokens": 8, "tools": tools, "messages": searched("Cron")})
    assert unknown.status == 400 and unknown.param == "messages[2].content[0].content[0].tool_name"
    assert "'Cron' is none of the request's tools" in unknown.message


THINKING_TURNS = [
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "t1", "signature": "s"},
                                      {"type": "text", "text": "r1"}]},
    {"role": "user", "content": "b"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "t2", "signature": "s"},
                                      {"type": "text", "text": "r2"}]},
    {"role": "user", "content": "c"},
]


@pytest.mark.parametrize(("edit", "kept"), [
    (None, ["t1", "t2"]),
    ({"type": "clear_thinking_20251015", "keep": "all"}, ["t1", "t2"]),  # what Claude Code sends
    ({"type": "clear_thinking_20251015"}, [None, "t2"]),  # Anthropic's default: the last thinking turn
    ({"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}, [None, None]),
    ({"type": "clear_tool_uses_20250919", "trigger": {"type": "input_tokens", "value": 30000}}, ["t1", "t2"]),
])
def test_clear_thinking_drops_the_thinking_of_older_turns(edit, kept):
    body = {"context_management": {"edits": [edit]}} if edit else {}
    messages = parse(messages=THINKING_TURNS, **body).turn.messages
    assert [m.reasoning for m in messages if m.role == "assistant"] == kept
    assert [m.content for m in messages] == ["a", "r1", "b", "r2", "c"]


HISTORY = [
    {"role": "user", "content": [{"type": "text", "text": "<reminder>"}, {"type": "text", "text": "Weather?"}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Paris, metric.", "signature": "sig"},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "metric": True}},
        {"type": "tool_use", "id": "toolu_2", "name": "get_time", "input": {"note": "café"}}]},
    {"role": "user", "content": [
        {"type": "text", "text": "Here you are."},
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "12:00"},
                                                                     {"type": "text", "text": "CET"}]},
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21 degrees", "is_error": False}]},
]


def test_history_blocks_become_messages_with_results_before_the_users_text():
    messages = parse(messages=HISTORY, tools=TOOLS).turn.messages
    assert messages == (
        Message("user", "<reminder>\nWeather?"),
        Message("assistant", "Let me look.", "Paris, metric.", (
            ToolCall("toolu_1", "get_weather", '{"city": "Paris", "metric": true}'),
            ToolCall("toolu_2", "get_time", '{"note": "café"}'))),  # ensure_ascii=False: the text as sent
        Message("tool", "12:00\nCET", tool_call_id="toolu_2", name="get_time"),
        Message("tool", "21 degrees", tool_call_id="toolu_1", name="get_weather"),
        Message("user", "Here you are."))


def test_a_reply_sent_back_re_renders_as_the_turn_it_was():
    """Turn k+1's messages start with turn k's, and the reply comes back as the Message it was made from."""
    first = parse(messages=HISTORY[:1], tools=TOOLS).turn.messages
    reply = WIRE.response("msg_1", parse(), result("Let me look.", "Paris, metric.", [
        ToolCall("toolu_1", "get_weather", '{"city":"Paris","metric":true}')], "tool_calls"))
    history = [*HISTORY[:1], {"role": "assistant", "content": reply["content"]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "21"}]}]
    second = parse(messages=history, tools=TOOLS).turn.messages
    assert second[:1] == first and second == parse(messages=history, tools=TOOLS).turn.messages
    generated = Message("assistant", "Let me look.", "Paris, metric.",
                        (ToolCall("toolu_1", "get_weather", '{"city":"Paris","metric":true}'),))
    assert second[1].template_dict() == generated.template_dict()


def test_count_tokens_needs_no_max_tokens():
    turn = WIRE.parse_count({"model": MODEL, "messages": HISTORY, "tools": TOOLS, "system": "S"})
    assert turn.messages[0] == Message("system", "S") and len(turn.messages) == 6 and len(turn.tools) == 2
    assert refused({"model": "other", "messages": USER}, count=True).status == 404
    assert refused({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
                   count=True).param == "messages[0].content[0].type"


# -- parse: bad bodies are 400s naming the field, in Anthropic's shape ------------------------------
def image(where: str = "source") -> dict:
    return {"type": "image", where: {"type": "base64", "media_type": "image/png", "data": "AAAA"}}


def document() -> dict:
    return {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "notes"}}


ASKED = [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_time", "input": {}}]}]


@pytest.mark.parametrize("body, param, words", [
    ({"messages": USER}, "max_tokens", "Field required"),
    ({"messages": USER, "max_tokens": "8"}, "max_tokens", "valid integer"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"messages": USER, "max_tokens": 8, "temperature": "hot"}, "temperature", "valid number"),
    ({"messages": USER, "max_tokens": 8, "top_p": 0}, "top_p", "top_p must be in (0, 1]"),
    ({"messages": USER, "max_tokens": 8, "stop_sequences": [""]}, "stop_sequences", "non-empty strings"),
    ({"messages": USER, "max_tokens": 8, "stop_sequences": "END"}, "stop_sequences", "valid list"),
    ({"messages": USER, "max_tokens": 8, "stream": "yes"}, "stream", "valid boolean"),
    ({"messages": USER, "max_tokens": 8, "context_management": {"edits": [
        {"type": "clear_thinking_20251015", "keep": {"type": "tool_uses", "value": 1}}]}},
     "context_management.edits[0].keep", "'all' or"),
    ({"messages": USER, "max_tokens": 8, "metadata": {"user_id": 7}}, "metadata.user_id", "valid string"),
    ({"messages": [], "max_tokens": 8}, "messages", "at least 1 item"),
    ({"messages": [{"role": "tool", "content": "x"}], "max_tokens": 8}, "messages[0].role",
     "'user', 'assistant' or 'system'"),
    ({"messages": [{"role": "user", "content": 7}], "max_tokens": 8}, "messages[0].content", "a string or a list"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}], "max_tokens": 8},
     "messages[0].content[0].type", "documents are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}], "max_tokens": 8},
     "messages[0].content[0].text", "Field required"),
    ({"messages": [{"role": "user", "content": [{"type": "search_result"}]}], "max_tokens": 8},
     "messages[0].content[0].type", "got 'search_result'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}],
      "max_tokens": 8}, "messages[0].content[0].type", "blocks of role 'user' must be"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}],
      "max_tokens": 8}, "messages[0].content[0].type", "blocks of role 'assistant' must be"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": "{}"}]}],
      "max_tokens": 8}, "messages[0].content[0].input", "valid dictionary"),
    ({"messages": [*USER, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}],
      "max_tokens": 8, "tools": TOOLS}, "messages[1].content[0].tool_use_id", "answers no earlier tool_use"),
    ({"messages": [*ASKED, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                          "content": [document()]}]}], "max_tokens": 8},
     "messages[1].content[0].content[0].type", "documents are not supported"),
    ({"messages": USER, "max_tokens": 8, "system": 7}, "system", "a string or a list of text blocks"),
    ({"messages": USER, "max_tokens": 8, "system": [image()]}, "system[0].type", "only text blocks"),
    ({"messages": USER, "max_tokens": 8, "tools": [{"name": "x"}]}, "tools[0].input_schema", "Field required"),
    ({"messages": USER, "max_tokens": 8, "tools": [{"name": "x", "input_schema": {"type": "string"}}]},
     "tools[0].input_schema", "of type 'object'"),
    ({"messages": USER, "max_tokens": 8, "tools": [{"type": "bash_20250124", "name": "bash"}]},
     "tools[0].input_schema", "Field required"),
    ({"messages": USER, "max_tokens": 8, "tools": [{"type": "web_search_20250305", "name": "s", "input_schema": {}}]},
     "tools[0].type", "'custom'"),
    ({"messages": USER, "max_tokens": 8, "tools": [TOOLS[0], TOOLS[0]]}, "tools", "repeated: ['get_weather']"),
    ({"messages": USER, "max_tokens": 8, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice.name", "'nope'"),
    ({"messages": USER, "max_tokens": 8, "tools": TOOLS, "tool_choice": {"type": "tool"}},
     "tool_choice.name", "Field required"),
    ({"messages": USER, "max_tokens": 8, "tool_choice": {"type": "any"}}, "tool_choice", "needs tools"),
    ({"messages": USER, "max_tokens": 8, "tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "valid dictionary"),
    ({"messages": USER, "max_tokens": 8, "tools": TOOLS, "tool_choice": {"type": "required"}},
     "tool_choice.type", "'auto', 'any', 'tool' or 'none'"),
    ({"messages": USER, "max_tokens": 8, "thinking": {"type": "enabled"}}, "thinking.budget_tokens", "Field required"),
    ({"messages": USER, "max_tokens": 8, "thinking": {"type": "on"}}, "thinking.type", "'enabled'"),
    ({"messages": USER, "max_tokens": 8, "output_config": {"format": {"type": "json_schema"}}},
     "output_config.format.schema", "Field required"),
])
def test_bad_bodies_are_400s_naming_the_field(body, param, words):
    error = refused({"model": MODEL, **body})
    assert (error.status, error.param) == (400, param), error.message
    assert words in error.message and error.message.startswith(param)
    wire = WIRE.error_body(error)
    assert wire == {"type": "error", "error": {"type": "invalid_request_error", "message": error.message}}
    no_extras(ErrorResponse.model_validate(wire))


def test_an_unknown_model_is_a_404_not_found_error():
    error = refused({"model": "claude-sonnet-4-5", "max_tokens": 8, "messages": USER})
    assert (error.status, error.param, error.code) == (404, "model", "model_not_found")
    assert WIRE.error_body(error)["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("error, kind", [
    (APIError(400, "bad"), "invalid_request_error"),
    (APIError(401, "key", code="invalid_api_key"), "authentication_error"),
    (APIError(403, "no"), "permission_error"),
    (APIError(404, "gone"), "not_found_error"),
    (APIError(429, "slow down"), "rate_limit_error"),
    (APIError(503, "queue full", code="queue_full", error_type="server_overloaded"), "overloaded_error"),
    (APIError(503, "engine died", code="engine_dead", error_type="server_error"), "api_error"),
    (APIError(504, "too long", code="request_timeout", error_type="server_error"), "timeout_error"),
    (APIError(500, "bug", error_type="server_error"), "api_error"),
])
def test_error_bodies_map_status_to_anthropics_error_types(error, kind):
    body = WIRE.error_body(error)
    assert body == {"type": "error", "error": {"type": kind, "message": error.message}}
    assert ErrorResponse.model_validate(body).error.type == kind


# -- response: the Message object ------------------------------------------------------------------
CALLS = [ToolCall("call_1", "get_weather", '{"city": "Paris", "metric": true}'),
         ToolCall("call_2", "get_time", "{}")]


def test_a_text_reply_and_its_usage():
    body = WIRE.response("msg_1", parse(), result("Hello."))
    assert body == {"id": "msg_1", "type": "message", "role": "assistant", "model": MODEL,
                    "content": [{"type": "text", "text": "Hello."}], "stop_reason": "end_turn", "stop_sequence": None,
                    "usage": {"input_tokens": 24, "output_tokens": 9, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 96}}  # input + cache reads = the prompt's 120
    no_extras(AnthropicMessage.model_validate(body))


def test_thinking_text_and_tool_use_blocks_in_order():
    body = WIRE.response("msg_2", parse(), result("Checking.", "They want Paris.", CALLS, "tool_calls"))
    assert body["content"] == [
        {"type": "thinking", "thinking": "They want Paris.", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris", "metric": True}},
        {"type": "tool_use", "id": "call_2", "name": "get_time", "input": {}}]
    assert body["stop_reason"] == "tool_use"
    message = AnthropicMessage.model_validate(body)
    no_extras(message)
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use", "tool_use"]


@pytest.mark.parametrize("turn_result, stop_reason, stop_sequence", [
    (result("a", finish="stop"), "end_turn", None),
    (result("a", finish="length"), "max_tokens", None),
    (result("a", finish="stop", stop_sequence="END"), "stop_sequence", "END"),
    (result("", calls=CALLS[:1], finish="tool_calls"), "tool_use", None),
    (result("a", finish="abort"), "end_turn", None),
])
def test_stop_reasons(turn_result, stop_reason, stop_sequence):
    body = WIRE.response("msg_3", parse(), turn_result)
    assert (body["stop_reason"], body["stop_sequence"]) == (stop_reason, stop_sequence)
    AnthropicMessage.model_validate(body)


# -- stream: the documented event sequence ---------------------------------------------------------
def check_sequence(events: list[tuple[str, dict]]) -> None:
    """message_start, then blocks numbered from 0 (start, deltas of its kind, stop), message_delta,
    message_stop; ping anywhere after message_start. Each event is the client's type, named in `event:`."""
    assert events[0][0] == "message_start" and [name for name, _ in events[-2:]] == ["message_delta", "message_stop"]
    open_block, next_index = None, 0
    delta_kinds = {"text": "text_delta", "thinking": ("thinking_delta", "signature_delta"),
                   "tool_use": "input_json_delta"}
    for name, data in events:
        assert data["type"] == name
        if name == "ping":
            continue
        event = STREAM_EVENT.validate_python(data)
        no_extras(event)
        if name == "content_block_start":
            assert open_block is None and data["index"] == next_index
            open_block, next_index = data["content_block"]["type"], next_index + 1
        elif name == "content_block_delta":
            assert open_block is not None and data["index"] == next_index - 1
            assert data["delta"]["type"] in delta_kinds[open_block]
        elif name == "content_block_stop":
            assert open_block is not None and data["index"] == next_index - 1
            open_block = None
        elif name in ("message_delta", "message_stop"):
            assert open_block is None
    assert [name for name, _ in events].count("message_start") == 1


def assemble(events: list[tuple[str, dict]]) -> dict:
    """The Message the events build, as a client accumulates it."""
    message, partial = None, {}
    for name, data in events:
        if name == "message_start":
            message = data["message"]
        elif name == "content_block_start":
            message["content"].append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = message["content"][data["index"]], data["delta"]
            if delta["type"] == "input_json_delta":
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
            else:
                key = {"text_delta": "text", "thinking_delta": "thinking", "signature_delta": "signature"}[delta["type"]]
                block[key] += delta[key]
        elif name == "content_block_stop" and data["index"] in partial:
            message["content"][data["index"]]["input"] = json.loads(partial[data["index"]])
        elif name == "message_delta":
            message.update(data["delta"])
            message["usage"].update(data["usage"])
    return message


def run_stream(feed, turn_result: TurnResult, **start) -> list[tuple[str, dict]]:
    stream = WIRE.stream("msg_s", parse(stream=True))
    events = stream.start(**start)
    for event in feed:
        events += stream.event(event)
    events += stream.finish(turn_result)
    return [(event.event, json.loads(event.data)) for event in events]


def test_a_text_stream():
    events = run_stream([TextDelta("Hel"), TextDelta(""), TextDelta("lo.")], result("Hello."), num_prompt_tokens=120)
    assert [name for name, _ in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                           "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    check_sequence(events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": 120, "output_tokens": 0, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 0}
    assert events[2][1]["content_block"] == {"type": "text", "text": ""}
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": 24, "output_tokens": 9, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 96}  # the full counts: message_start could not know the cache's
    assert assemble(events) == WIRE.response("msg_s", parse(), result("Hello."))


def test_thinking_then_text_are_two_blocks():
    final = result("Hi.", "User greets.")
    events = run_stream([ReasoningDelta("User "), ReasoningDelta("greets."), TextDelta("Hi.")], final)
    check_sequence(events)
    blocks = [data for name, data in events if name == "content_block_start"]
    assert [b["content_block"] for b in blocks] == [{"type": "thinking", "thinking": "", "signature": ""},
                                                    {"type": "text", "text": ""}]
    thinking_deltas = [data["delta"] for name, data in events if name == "content_block_delta" and data["index"] == 0]
    assert thinking_deltas[-1] == {"type": "signature_delta", "signature": ""}  # closed as the API closes it
    assert assemble(events) == WIRE.response("msg_s", parse(), final)


def test_text_then_two_tool_calls_stream_their_inputs_as_json_deltas():
    final = result("Checking.", calls=CALLS, finish="tool_calls")
    feed = [TextDelta("Checking."),
            ToolCallStart(0, "call_1", "get_weather"), ToolArgumentsDelta(0, '{"city": "Pa'),
            ToolArgumentsDelta(0, 'ris", "metric": '), ToolArgumentsDelta(0, "true}"), ToolCallEnd(0),
            ToolCallStart(1, "call_2", "get_time"), ToolArgumentsDelta(1, "{}"), ToolCallEnd(1)]
    events = run_stream(feed, final)
    check_sequence(events)
    assert [data["content_block"] for name, data in events if name == "content_block_start"] == [
        {"type": "text", "text": ""}, {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}},
        {"type": "tool_use", "id": "call_2", "name": "get_time", "input": {}}]
    for index, call in enumerate(CALLS, start=1):
        pieces = [data["delta"]["partial_json"] for name, data in events
                  if name == "content_block_delta" and data["index"] == index]
        assert json.loads("".join(pieces)) == json.loads(call.arguments)
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    assembled = assemble(events)
    assert assembled == WIRE.response("msg_s", parse(), final)
    no_extras(AnthropicMessage.model_validate(assembled))


def test_a_call_cut_by_max_tokens_has_an_empty_input():
    body = WIRE.response("msg_4", parse(), result(calls=[ToolCall("call_1", "get_weather", '{"city": "Pa')],
                                                  finish="length"))
    assert body["content"] == [{"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}]
    assert body["stop_reason"] == "max_tokens"
    AnthropicMessage.model_validate(body)


def test_a_call_cut_by_max_tokens_is_closed_at_the_finish():
    events = run_stream([ToolCallStart(0, "call_1", "get_weather"), ToolArgumentsDelta(0, '{"ci')],
                        result(finish="length"))
    check_sequence(events)
    assert [name for name, _ in events][-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_an_event_for_a_call_that_is_not_open_is_a_bug():
    stream = WIRE.stream("msg_s", parse(stream=True))
    stream.start()
    stream.event(TextDelta("a"))
    with pytest.raises(ValueError, match="call 0"):
        stream.event(ToolArgumentsDelta(0, "{}"))


def test_a_failure_under_way_ends_the_stream_with_an_error_event():
    stream = WIRE.stream("msg_s", parse(stream=True))
    stream.start()
    stream.event(TextDelta("a"))
    event, = stream.error(APIError(504, "ran past the request timeout", error_type="server_error"))
    assert event.event == "error"
    body = ErrorResponse.model_validate(json.loads(event.data))
    assert body.type == "error" and body.error.type == "timeout_error"


# -- part 2: the official client over loopback against `tinymlx serve` ------------------------------
@pytest.fixture(scope="module")
def server(default_model_dir):
    # Imported here: the unit tests above need neither the server nor the engine.
    from server_harness import RunningServer
    from tiny_models import tiny_qwen_engine

    running = RunningServer(tiny_qwen_engine(default_model_dir))
    yield running
    running.close()


@pytest.fixture
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)


# The 2.x client has no sampling arguments of its own: greedy decoding goes in the body's extra fields.
GREEDY = {"extra_body": {"temperature": 0}}


def raw_events(server, body: dict) -> list[tuple[str, dict]]:
    """The SSE stream as sent: (event name, data) pairs."""
    events, name = [], None
    with httpx.stream("POST", f"{server.base_url}/v1/messages", json={**body, "stream": True, "temperature": 0},
                      timeout=60) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.iter_lines():
            if line.startswith("event:"):
                name = line.removeprefix("event:").strip()
            elif line.startswith("data:"):
                events.append((name, json.loads(line.removeprefix("data:"))))
    return events


def test_a_streamed_reply_follows_the_documented_sequence_and_matches_the_non_streamed_one(claude, server):
    body = {"model": server.model, "max_tokens": 12, "messages": USER}
    reply = claude.messages.create(**body, **GREEDY)
    AnthropicMessage.model_validate(reply.model_dump())
    events = raw_events(server, body)
    check_sequence(events)
    assembled = AnthropicMessage.model_validate(assemble(events))
    assert assembled.content == reply.content and assembled.stop_reason == reply.stop_reason
    assert assembled.usage.output_tokens == reply.usage.output_tokens
    assert assembled.usage.input_tokens + assembled.usage.cache_read_input_tokens == \
        reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    with claude.messages.stream(**body, **GREEDY) as stream:  # the client's own accumulation
        final = stream.get_final_message()
    assert [b.model_dump(exclude={"parsed_output"}) for b in final.content] == [b.model_dump() for b in reply.content]
    assert final.stop_reason == reply.stop_reason
    server.wait_idle()


def test_a_forced_tool_use_validates_streamed_and_not(claude, server):
    body = {"model": server.model, "max_tokens": 200, "tools": TOOLS,  # room for the noise model's whitespace
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    reply = claude.messages.create(**body, **GREEDY)
    calls = [block for block in reply.content if block.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and [c.name for c in calls] == ["get_weather"]
    for call in calls:
        jsonschema.validate(call.input, WEATHER)
    events = raw_events(server, body)
    check_sequence(events)
    streamed = [block for block in assemble(events)["content"] if block["type"] == "tool_use"]
    assert [(b["name"], b["input"]) for b in streamed] == [(c.name, c.input) for c in calls]
    with claude.messages.stream(**body, **GREEDY) as stream:
        final = stream.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(c.name, c.input) for c in calls]
    server.wait_idle()


def test_a_tool_a_tool_reference_loaded_is_called_and_the_turns_prefix_is_cached(claude, server):
    """The turn after a ToolSearch: the deferred tool it loaded is forced and comes back as a valid call;
    the turn repeats the earlier turn's prompt (the same tool list) and is served from the cache."""
    tools = [*TOOLS, SEARCH, PLACEHOLDER, FETCH]
    first = claude.messages.create(model=server.model, max_tokens=8, tools=tools, messages=searched("WebFetch")[:1],
                                   **GREEDY)
    body = {"model": server.model, "max_tokens": 200, "tools": tools, "messages": searched("WebFetch"),
            "tool_choice": {"type": "tool", "name": "WebFetch"}}
    reply = claude.messages.create(**body, **GREEDY)
    calls = [block for block in reply.content if block.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and [(c.name, c.input) for c in calls] == [("WebFetch", {"url": "https://a.b/"})]
    assert reply.usage.cache_read_input_tokens >= first.usage.input_tokens + first.usage.cache_read_input_tokens - 16
    server.wait_idle()


def test_a_stop_sequence_is_reported(claude, server):
    body = {"model": server.model, "max_tokens": 16, "messages": USER}
    text = claude.messages.create(**body, **GREEDY).content[0].text
    words = [piece for piece in text.split() if len(piece) >= 2]
    assert words, f"the tiny model said nothing to stop at: {text!r}"
    stop = words[0][:2]
    reply = claude.messages.create(**body, stop_sequences=[stop], **GREEDY)
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)
    assert stop not in "".join(block.text for block in reply.content if block.type == "text")
    server.wait_idle()


def test_client_errors_arrive_as_the_clients_exceptions(claude, server):
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=USER)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError, match="documents are not supported"):
        claude.messages.create(model=server.model, max_tokens=4, messages=[{"role": "user", "content": [document()]}])
    assert claude.messages.create(model=server.model, max_tokens=2, messages=USER, **GREEDY).usage.output_tokens == 2
    server.wait_idle()


def test_max_tokens_past_the_context_runs_to_its_end_streamed_and_not(small_context_server):
    """Claude Code always asks for 32000: the reply is what the context leaves, ending in "max_tokens"."""
    server = small_context_server
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    body = {"model": server.model, "max_tokens": 32000, "messages": USER}
    reply = claude.messages.create(**body, **GREEDY, timeout=60)  # the client wants one to wait for 32000
    num_prompt = claude.messages.count_tokens(model=server.model, messages=USER).input_tokens
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == num_prompt
    assert (reply.stop_reason, reply.usage.output_tokens) == ("max_tokens", 64 - num_prompt)
    events = raw_events(server, body)
    check_sequence(events)
    assembled = AnthropicMessage.model_validate(assemble(events))
    assert (assembled.stop_reason, assembled.usage.output_tokens) == ("max_tokens", 64 - num_prompt)
    assert assembled.content == reply.content
    server.wait_idle()


def test_a_prompt_that_alone_fills_the_context_is_a_400_naming_the_numbers(small_context_server):
    server = small_context_server
    claude = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    long = [{"role": "user", "content": "word " * 40}]
    num_prompt = claude.messages.count_tokens(model=server.model, messages=long).input_tokens
    for stream in (False, True):
        reply = httpx.post(f"{server.base_url}/v1/messages", timeout=60,
                           json={"model": server.model, "max_tokens": 32000, "messages": long, "stream": stream})
        assert reply.status_code == 400 and reply.headers["content-type"].startswith("application/json")
        error = ErrorResponse.model_validate(reply.json()).error
        assert (error.type, error.message) == ("invalid_request_error", f"the prompt ({num_prompt} tokens) leaves "
                                               "no room in the maximum context of 64 tokens; shorten it")
    server.wait_idle()
