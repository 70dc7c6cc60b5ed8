"""The Responses API: bodies -> TurnRequests, TurnResults -> Response bodies and events, then the
same over loopback HTTP through `tinymlx serve`.

The reference is the official `openai` client: every Response body and every stream event is
validated with its pydantic types, each event with the model its `type` names. The server part runs
the tiny random model behind the real Qwen2.5 tokenizer and template: its text is noise, so only
forced calls and constrained formats are checked for content.
"""

from __future__ import annotations

import json
import re
import typing

import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from server_harness import RunningServer
from tiny_models import tiny_qwen_engine

from tinymlx.server.responses.api import OpenAIResponses
from tinymlx.server.responses.body import ResponsesTurnRequest
from tinymlx.server.responses.sealed_reasoning import seal
from tinymlx.server.responses.tools import ToolOrigin
from tinymlx.turns.api_error import APIError
from tinymlx.turns.turn import (
    ChatTurn,
    Freeform,
    Message,
    ReasoningDelta,
    TextDelta,
    Tool,
    ToolArgumentsDelta,
    ToolCall,
    ToolCallEnd,
    ToolCallStart,
    TurnRequest,
    TurnResult,
)

MODEL = "tiny"
WEATHER = {"type": "function", "name": "weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CLOCK = {"type": "function", "name": "clock", "parameters": {"type": "object", "properties": {}}}

# ResponseStreamEvent's members by their `type`, so each event is checked against exactly its own model.
EVENT_MODELS = {typing.get_args(cls.model_fields["type"].annotation)[0]: cls
                for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])}


def parse(wire: OpenAIResponses | None = None, **fields) -> ResponsesTurnRequest:
    return (wire or OpenAIResponses(MODEL)).parse({"model": MODEL, "input": "hi", **fields})


def refused(wire: OpenAIResponses | None = None, **fields) -> APIError:
    with pytest.raises(APIError) as info:
        parse(wire, **fields)
    return info.value


def result(text: str = "", reasoning: str | None = None, calls: tuple[ToolCall, ...] = (),
           finish_reason: str | None = None) -> TurnResult:
    return TurnResult(text, reasoning, list(calls), finish_reason or ("tool_calls" if calls else "stop"),
                      num_prompt_tokens=12, num_completion_tokens=7, num_cached_tokens=4)


def events_of(sse_events) -> list[dict]:
    """Each event's JSON, after checking it against the openai type its `type` names."""
    events = []
    for sse in sse_events:
        data = json.loads(sse.data)
        assert sse.event == data["type"]
        EVENT_MODELS[data["type"]].model_validate(data)
        events.append(data)
    return events


def streamed(wire: OpenAIResponses, request: TurnRequest, deltas, final: TurnResult,
             request_id: str = "resp_s1") -> list[dict]:
    stream = wire.stream(request_id, request)
    sse = stream.start()
    for delta in deltas:
        sse += stream.event(delta)
    events = events_of(sse + stream.finish(final))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


# -- parse ----------------------------------------------------------------------------------------
def test_a_string_input_with_instructions_and_every_sampling_field():
    request = parse(instructions="Be brief.", temperature=0, top_p=0.9, max_output_tokens=32, stream=True,
                    user="ana", top_k=5, min_p=0.1, repetition_penalty=1.1, presence_penalty=0.5,
                    frequency_penalty=0.2, seed=7, stop=["\n\n"], stop_token_ids=[2], priority=3,
                    metadata={"run": "1"})
    assert request.turn.messages == (Message("system", "Be brief."), Message("user", "hi"))
    assert request.history == (Message("user", "hi"),)  # what a chained response inherits: no instructions
    assert request.sampling == {"temperature": 0.0, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
                                "presence_penalty": 0.5, "frequency_penalty": 0.2, "seed": 7, "stop": ["\n\n"],
                                "stop_token_ids": [2]}
    assert (request.model, request.max_tokens, request.stream, request.user, request.priority) == \
        (MODEL, 32, True, "ana", 3)
    assert request.constraint == {} and request.store and request.turn.tools == ()
    assert request.echo["metadata"] == {"run": "1"} and request.echo["instructions"] == "Be brief."


def test_defaults():
    request = parse()
    assert (request.max_tokens, request.stream, request.store, request.sampling) == (None, False, True, {})
    assert request.turn == ChatTurn((Message("user", "hi"),), (), "auto", True, {})


def test_items_become_messages():
    request = parse(input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                        {"type": "input_text", "text": "Oslo and the time?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Two."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "c2", "name": "clock", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "12:00"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Report."}]},
        {"type": "function_call", "call_id": "c3", "name": "clock", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3", "output": "12:01"},
        {"role": "system", "content": "Answer now."},
    ])
    calls = (ToolCall("c1", "weather", '{"city": "Oslo"}'), ToolCall("c2", "clock", "{}"))
    assert request.turn.messages == (
        Message("system", "Use tools."),
        Message("user", "Weather in Oslo and the time?"),
        Message("assistant", "Checking.", "Two.", calls),  # the text and the calls after it: one turn
        Message("tool", "rain", tool_call_id="c1", name="weather"),
        Message("tool", "12:00", tool_call_id="c2", name="clock"),
        Message("assistant", "", "Report.", (ToolCall("c3", "clock", "{}"),)),
        Message("tool", "12:01", tool_call_id="c3", name="clock"),
        Message("system", "Answer now."),
    )


def test_reasoning_without_a_reply_after_it_is_an_assistant_message_of_its_own():
    request = parse(input=[{"role": "user", "content": "a"},
                           {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
                           {"role": "user", "content": "b"},
                           {"type": "reasoning", "summary": [], "encrypted_content": seal("s")}])
    assert request.turn.messages == (Message("user", "a"), Message("assistant", "", "r"), Message("user", "b"),
                                     Message("assistant", "", "s"))


def test_tools_and_tool_choice():
    request = parse(tools=[WEATHER, {**CLOCK, "strict": False}], tool_choice={"type": "function", "name": "clock"},
                    parallel_tool_calls=False)
    assert request.turn.tools == (Tool("weather", "The weather in a city.", WEATHER["parameters"]),
                                  Tool("clock", "", CLOCK["parameters"]))
    assert (request.turn.tool_choice, request.turn.parallel_tool_calls) == ("clock", False)
    assert request.echo["tool_choice"] == {"type": "function", "name": "clock"}
    assert [t["strict"] for t in request.echo["tools"]] == [True, False]  # strict defaults to true
    for choice in ("auto", "none", "required"):
        assert parse(tools=[WEATHER], tool_choice=choice).turn.tool_choice == choice
    no_parameters = parse(tools=[{"type": "function", "name": "ping"}]).turn.tools[0]
    assert no_parameters.parameters == {"type": "object", "properties": {}}


NAMESPACE = {"type": "namespace", "name": "agents", "description": "Sub-agents.",
             "tools": [{"type": "function", "name": "spawn", "parameters": {
                 "type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"],
                 "additionalProperties": False}},
                       {"type": "custom", "name": "script", "description": "A script."}]}
PATCH_GRAMMAR = 'start: "*** Begin Patch" LF line+ "*** End Patch"\nline: "+" /(.*)/ LF -> add\n%import common.LF\n'
PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
         "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}


def test_namespace_tools_are_flattened_custom_tools_take_raw_input_hosted_tools_are_left_out(caplog):
    with caplog.at_level("INFO", logger="tinymlx.server"):
        request = parse(tools=[WEATHER, NAMESPACE, PATCH, {"type": "web_search", "external_web_access": False},
                               {"type": "tool_search", "execution": "client"}])
    assert [tool.name for tool in request.turn.tools] == ["weather", "agents__spawn", "agents__script", "apply_patch"]
    patch = request.turn.tools[3]
    assert patch.freeform == Freeform("lark", PATCH_GRAMMAR)
    assert patch.parameters["required"] == ["input"] and PATCH_GRAMMAR in patch.parameters["properties"]["input"][
        "description"]
    assert request.turn.tools[2].freeform == Freeform("text")
    assert request.tool_origins == {"agents__spawn": ToolOrigin("spawn", "agents"),
                                    "agents__script": ToolOrigin("script", "agents", custom=True),
                                    "apply_patch": ToolOrigin("apply_patch", custom=True)}
    assert "left out hosted tools this server cannot run: web_search, tool_search" in caplog.text
    assert [tool["type"] for tool in request.echo["tools"]] == ["function", "namespace", "custom"]
    forced = parse(tools=[NAMESPACE], tool_choice={"type": "function", "name": "spawn", "namespace": "agents"})
    assert forced.turn.tool_choice == "agents__spawn"
    assert parse(tools=[PATCH], tool_choice={"type": "custom", "name": "apply_patch"}).turn.tool_choice == "apply_patch"


def test_additional_tools_items_add_their_tools():
    """Codex starts a sub-agent (multi_agent_v1's spawn_agent) with its tools in an additional_tools item."""
    extra = {"type": "additional_tools", "role": "developer", "tools": [CLOCK, NAMESPACE]}
    request = parse(tools=[WEATHER, CLOCK], input=[extra, {"role": "user", "content": "go"}])
    assert [tool.name for tool in request.turn.tools] == ["weather", "clock", "agents__spawn", "agents__script"]
    assert request.turn.messages == (Message("user", "go"),)
    assert refused(input=[{"type": "additional_tools", "tools": "x"}, {"role": "user", "content": "go"}]).param == \
        "input[0].tools"


def test_a_tool_output_without_a_call_is_context_named_by_its_tool():
    """Codex adds its goal as agent.goal_objective's output, answering no call."""
    goal = {"type": "function_call_output", "name": "goal_objective", "namespace": "agent", "output": "Fix it."}
    request = parse(input=[{"role": "user", "content": "go"}, goal])
    assert request.turn.messages[1] == Message("tool", "Fix it.", name="agent__goal_objective")
    assert refused(input=[{"type": "function_call_output", "output": "x"}]).param == "input[0].call_id"


def test_a_name_clash_after_flattening_is_a_400_naming_the_name():
    error = refused(tools=[NAMESPACE, {"type": "function", "name": "agents__spawn"}])
    assert (error.status, error.param) == (400, "tools") and "'agents__spawn'" in error.message
    assert "<namespace>__<name>" in error.message


def test_calls_go_back_under_the_clients_names_and_come_back_flattened():
    wire = OpenAIResponses(MODEL)
    request = parse(wire, tools=[NAMESPACE, PATCH])
    calls = (ToolCall("call_1", "agents__spawn", '{"n": 1}'),
             ToolCall("call_2", "apply_patch", json.dumps({"input": "*** Begin Patch\n+x\n*** End Patch"})))
    body = wire.response("resp_1", request, result(calls=calls))
    Response.model_validate(body)
    spawn, patch = body["output"]
    assert (spawn["type"], spawn["name"], spawn["namespace"]) == ("function_call", "spawn", "agents")
    assert (patch["type"], patch["name"], patch["input"]) == \
        ("custom_tool_call", "apply_patch", "*** Begin Patch\n+x\n*** End Patch")
    assert "namespace" not in patch
    # Sent back as input (store false), the calls render as the same ToolCalls.
    outputs = [{"type": "function_call_output", "call_id": "call_1", "output": "ok"},
               {"type": "custom_tool_call_output", "call_id": "call_2", "output": "done"}]
    again = parse(wire, tools=[NAMESPACE, PATCH], input=[{"role": "user", "content": "go"}, spawn, patch, *outputs])
    assert again.turn.messages[1] == Message("assistant", "", None, calls)
    assert [(m.role, m.name, m.content) for m in again.turn.messages[2:]] == \
        [("tool", "agents__spawn", "ok"), ("tool", "apply_patch", "done")]


def test_a_custom_call_streams_its_input_whole_when_it_closes():
    wire = OpenAIResponses(MODEL)
    request = parse(wire, tools=[PATCH], stream=True)
    arguments = json.dumps({"input": "*** Begin Patch\n+x\n*** End Patch"})
    deltas = [ToolCallStart(0, "call_p", "apply_patch"), ToolArgumentsDelta(0, arguments[:9]),
              ToolArgumentsDelta(0, arguments[9:]), ToolCallEnd(0)]
    events = streamed(wire, request, deltas, result(calls=(ToolCall("call_p", "apply_patch", arguments),)))
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added", "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done", "response.output_item.done", "response.completed"]
    assert events[2]["item"]["input"] == "" and events[3]["delta"] == events[4]["input"] == \
        "*** Begin Patch\n+x\n*** End Patch"
    assert events[-1]["response"]["output"] == wire.response("resp_s1", request, result(
        calls=(ToolCall("call_p", "apply_patch", arguments),)))["output"]


def test_sealed_reasoning_round_trips_byte_identically_and_summary_is_the_reasoning():
    wire = OpenAIResponses(MODEL)
    thinking = "Let me think: \"quotes\", ünïcode, </think> and\nnewlines."
    request = parse(wire, reasoning={"summary": "auto"}, include=["reasoning.encrypted_content"], store=False,
                    stream=True)
    events = streamed(wire, request, [ReasoningDelta(thinking[:10]), ReasoningDelta(thinking[10:]), TextDelta("Hi.")],
                      result("Hi.", thinking))
    kinds = [e["type"] for e in events]
    assert kinds.count("response.reasoning_summary_text.delta") == 2
    assert "response.reasoning_summary_part.done" in kinds
    item = events[-1]["response"]["output"][0]
    assert item["summary"] == [{"type": "summary_text", "text": thinking}]
    assert item == wire.response("resp_s1", request, result("Hi.", thinking))["output"][0]
    # Codex sends the item back without its content: the sealed text alone restores the reasoning.
    sent_back = {"type": "reasoning", "summary": item["summary"], "encrypted_content": item["encrypted_content"]}
    again = parse(wire, input=[{"role": "user", "content": "q"}, sent_back,
                               {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "more"}])
    assert again.turn.messages[1] == Message("assistant", "Hi.", thinking)
    plain = wire.response("resp_2", parse(wire), result("Hi.", thinking))["output"][0]
    assert "encrypted_content" not in plain and plain["summary"] == []


def test_codex_fields_are_accepted():
    request = parse(prompt_cache_key="session-1", client_metadata={"turn_id": "t"}, text={"verbosity": "low"},
                    include=["reasoning.encrypted_content"], store=False,
                    input=[{"type": "message", "id": "msg_1", "role": "developer",
                            "content": [{"type": "input_text", "text": "Be terse."}]}])
    assert request.turn.messages == (Message("system", "Be terse."),) and request.seals_reasoning
    assert request.echo["text"]["verbosity"] == "low"


@pytest.mark.parametrize(("text_format", "constraint"), [
    ({"type": "text"}, {}),
    ({"type": "json_object"}, {"json_object": True}),
    ({"type": "json_schema", "name": "city", "strict": True,
      "schema": {"type": "object", "properties": {"name": {"type": "string"}}}},
     {"json_schema": {"type": "object", "properties": {"name": {"type": "string"}}}}),
])
def test_text_format_is_the_constraint(text_format, constraint):
    request = parse(text={"format": text_format, "verbosity": "low"})
    assert request.constraint == constraint
    assert request.echo["text"] == {"format": text_format, "verbosity": "low"}


@pytest.mark.parametrize(("reasoning", "kwargs", "expected"), [
    (None, None, {}),  # unset: the template's own default
    ({"effort": "none"}, None, {"enable_thinking": False, "reasoning_effort": "none"}),
    ({"effort": "minimal"}, None, {"enable_thinking": True, "reasoning_effort": "minimal"}),
    ({"effort": "high", "summary": "auto"}, None, {"enable_thinking": True, "reasoning_effort": "high"}),
    ({"effort": "high"}, {"enable_thinking": False, "x": 1}, {"enable_thinking": False, "reasoning_effort": "high",
                                                             "x": 1}),
    (None, {"custom": "v"}, {"custom": "v"}),
])
def test_reasoning_effort_and_chat_template_kwargs(reasoning, kwargs, expected):
    fields = {k: v for k, v in (("reasoning", reasoning), ("chat_template_kwargs", kwargs)) if v is not None}
    assert parse(**fields).turn.template_kwargs == expected


def image(kind: str) -> dict:
    return {"role": "user", "content": [{"type": "input_text", "text": "see"}, {"type": kind, "image_url": "x"}]}


@pytest.mark.parametrize(("fields", "param"), [
    ({"model": 3}, "model"),
    ({"input": 5}, "input"),
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": "9"}, "max_output_tokens"),
    ({"stream": "yes"}, "stream"),
    ({"store": 1}, "store"),
    ({"instructions": ["a"]}, "instructions"),
    ({"seed": -1}, "seed"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "{}"}]}, "tools[0].parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [image("input_image")]}, "input[0].content[1]"),  # its image_url "x" is no image
    ({"input": [image("input_file")]}, "input[0].content[1].type"),
    ({"input": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "message", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": ["hi"]}, "input[0]"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"tools": [{"type": "calculator"}]}, "tools[0].type"),
    ({"tools": [{"type": "namespace", "name": "ns", "description": "d", "tools": []}]}, "tools[0].tools"),
    ({"tools": [{"type": "namespace", "name": "ns", "description": "d", "tools": [{"type": "web_search"}]}]},
     "tools[0].tools[0].type"),
    ({"tools": [{"type": "custom", "name": "patch", "format": {"type": "grammar", "syntax": "lark"}}]},
     "tools[0].format"),
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"include": ["reasoning.everything"]}, "include[0]"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAAABo-openai-blob"}]},
     "input[0].encrypted_content"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": seal("mine")[:-1] + "0"}]},
     "input[0].encrypted_content"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"top_logprobs": 3}, "top_logprobs"),
])
def test_bad_bodies_are_400s_naming_the_field(fields, param):
    error = refused(**fields)
    assert (error.status, error.param) == (400, param)
    body = OpenAIResponses(MODEL).error_body(error)
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]


def test_a_schema_the_engine_cannot_compile_is_left_to_the_engine():
    # SamplingParams only checks a schema is JSON; compiling it against the tokenizer is the engine's check.
    assert parse(text={"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}}).constraint


def test_an_unknown_previous_response_id_is_a_404_in_openai_shape():
    error = refused(previous_response_id="resp_nope")
    assert error.status == 404
    assert OpenAIResponses(MODEL).error_body(error) == {"error": {
        "message": "Previous response with id 'resp_nope' not found.", "type": "invalid_request_error",
        "param": "previous_response_id", "code": "previous_response_not_found"}}


# -- Response bodies ------------------------------------------------------------------------------
def test_the_response_validates_with_the_openai_type():
    wire = OpenAIResponses(MODEL)
    request = parse(wire, instructions="Be brief.", tools=[WEATHER], temperature=0.5, max_output_tokens=64,
                    text={"format": {"type": "json_object"}}, reasoning={"effort": "low"}, metadata={"k": "v"})
    body = wire.response("resp_1", request, result("It rains.", "Look it up.", (ToolCall("call_a", "weather",
                                                                                          '{"city":"Oslo"}'),)))
    response = Response.model_validate(body)
    assert (response.id, response.object, response.status, response.model) == ("resp_1", "response", "completed",
                                                                                MODEL)
    assert [item.type for item in response.output] == ["reasoning", "message", "function_call"]
    assert response.output[0].content[0].text == "Look it up."
    assert response.output_text == "It rains."  # the SDK's convenience property, from the message item
    call = response.output[2]
    assert (call.call_id, call.name, call.arguments, call.status) == ("call_a", "weather", '{"city":"Oslo"}',
                                                                      "completed")
    assert len({item.id for item in response.output}) == 3
    assert response.usage.model_dump() == {"input_tokens": 12, "output_tokens": 7, "total_tokens": 19,
                                           "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0,
                                                                    "cache_write_tokens_details": None},
                                           "output_tokens_details": {"reasoning_tokens": 0}}
    assert (response.instructions, response.temperature, response.max_output_tokens, response.store) == \
        ("Be brief.", 0.5, 64, True)
    assert response.tools[0].name == "weather" and response.tool_choice == "auto"
    assert response.text.format.type == "json_object" and response.reasoning.effort == "low"
    assert response.metadata == {"k": "v"} and response.previous_response_id is None


def test_a_reply_cut_by_max_output_tokens_is_incomplete():
    wire = OpenAIResponses(MODEL)
    response = Response.model_validate(wire.response("resp_1", parse(wire), result("It ra", finish_reason="length")))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[-1].status == "incomplete"


def test_an_empty_reply_still_has_a_message():
    wire = OpenAIResponses(MODEL)
    response = Response.model_validate(wire.response("resp_1", parse(wire), result("")))
    assert [item.type for item in response.output] == ["message"] and response.output_text == ""


def test_a_plain_turn_request_is_answered_too():
    # The server may hand back a TurnRequest it rebuilt; the body then echoes what the turn says.
    wire = OpenAIResponses(MODEL)
    turn = ChatTurn((Message("user", "hi"),), (Tool("f", "", {"type": "object"}),), "f")
    body = wire.response("resp_1", TurnRequest(MODEL, turn, {"temperature": 0.2}), result("ok"))
    response = Response.model_validate(body)
    assert response.tool_choice.name == "f" and response.temperature == 0.2
    assert wire.parse({"model": MODEL, "input": "more", "previous_response_id": "resp_1"}).turn.messages == (
        Message("user", "hi"), Message("assistant", "ok"), Message("user", "more"))


# -- previous_response_id and the store -----------------------------------------------------------
def test_three_chained_turns_grow_the_conversation_without_carrying_instructions():
    wire = OpenAIResponses(MODEL)
    first = parse(wire, input="Weather in Oslo?", instructions="Be brief.", tools=[WEATHER])
    call = ToolCall("call_1", "weather", '{"city": "Oslo"}')
    wire.response("resp_1", first, result("", "Need the tool.", (call,)))

    second = parse(wire, previous_response_id="resp_1", tools=[WEATHER], instructions="Be very brief.",
                   input=[{"type": "function_call_output", "call_id": "call_1", "output": "rain"}])
    turn_1 = (Message("user", "Weather in Oslo?"), Message("assistant", "", "Need the tool.", (call,)))
    tool = Message("tool", "rain", tool_call_id="call_1", name="weather")
    assert second.turn.messages == (Message("system", "Be very brief."), *turn_1, tool)
    stream = wire.stream("resp_2", second)  # the second turn is streamed: finish() stores it the same
    stream.start()
    stream.event(TextDelta("Rain."))
    stream.finish(result("Rain."))

    third = parse(wire, previous_response_id="resp_2", input="Tomorrow?")
    assert third.turn.messages == (*turn_1, tool, Message("assistant", "Rain."), Message("user", "Tomorrow?"))
    body = wire.response("resp_3", third, result("Sun."))
    assert body["previous_response_id"] == "resp_2" and body["instructions"] is None
    fourth = parse(wire, previous_response_id="resp_3", input="Thanks.")
    assert len(fourth.turn.messages) == len(third.turn.messages) + 2
    assert Response.model_validate(wire.get("resp_2")).output_text == "Rain."


def test_the_store_is_a_bounded_lru():
    wire = OpenAIResponses(MODEL, store_size=2)
    for i in (1, 2):
        wire.response(f"resp_{i}", parse(wire, input=f"q{i}"), result(f"a{i}"))
    assert wire.get("resp_1")["output"][0]["content"][0]["text"] == "a1"  # resp_1 is now the most recent
    wire.response("resp_3", parse(wire, input="q3"), result("a3"))
    assert wire.get("resp_2") is None and wire.get("resp_1") is not None and wire.get("resp_3") is not None
    assert refused(wire, previous_response_id="resp_2").status == 404
    parse(wire, previous_response_id="resp_1")  # using resp_1 keeps it: resp_3 goes next
    wire.response("resp_4", parse(wire, input="q4"), result("a4"))
    assert [wire.get(f"resp_{i}") is not None for i in (1, 3, 4)] == [True, False, True]
    assert wire.delete("resp_4") and not wire.delete("resp_4") and wire.get("resp_4") is None


def test_store_false_is_not_stored():
    wire = OpenAIResponses(MODEL)
    body = wire.response("resp_1", parse(wire, store=False), result("a"))
    assert body["store"] is False and wire.get("resp_1") is None
    stream = wire.stream("resp_2", parse(wire, store=False))
    stream.start()
    stream.finish(result("a"))
    assert wire.get("resp_2") is None
    assert OpenAIResponses(MODEL, store_size=0).get("resp_1") is None


def test_get_returns_a_copy():
    wire = OpenAIResponses(MODEL)
    wire.response("resp_1", parse(wire), result("a"))
    wire.get("resp_1")["output"].clear()
    assert wire.get("resp_1")["output"]


# -- the stream -----------------------------------------------------------------------------------
def test_a_text_stream():
    wire = OpenAIResponses(MODEL)
    events = streamed(wire, parse(wire, stream=True), [TextDelta("Hel"), TextDelta(""), TextDelta("lo")],
                      result("Hello"))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[2]["item"]["status"] == "in_progress" and events[2]["item"]["content"] == []
    assert {(e["output_index"], e["item_id"], e["content_index"]) for e in events[3:8]} == {(0, "msg_s1_0", 0)}
    assert events[6]["text"] == "Hello" and events[7]["part"]["text"] == "Hello"
    assert events[8]["item"]["status"] == "completed"
    final = Response.model_validate(events[-1]["response"])
    assert final.output_text == "Hello" and final.usage.input_tokens == 12
    assert final.created_at == events[0]["response"]["created_at"]


def test_reasoning_then_text():
    wire = OpenAIResponses(MODEL)
    deltas = [ReasoningDelta("Think"), ReasoningDelta("ing."), TextDelta("Done.")]
    events = streamed(wire, parse(wire), deltas, result("Done.", "Thinking."))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert events[3]["part"] == {"type": "reasoning_text", "text": ""}
    assert events[6]["text"] == "Thinking." and events[8]["item"]["content"][0]["text"] == "Thinking."
    assert [e["output_index"] for e in events if e["type"].endswith(".added")] == [0, 0, 1, 1]
    final = Response.model_validate(events[-1]["response"])
    assert [item.type for item in final.output] == ["reasoning", "message"] and final.output_text == "Done."


def test_text_then_two_function_calls():
    wire = OpenAIResponses(MODEL)
    calls = (ToolCall("call_a", "weather", '{"city": "Oslo"}'), ToolCall("call_b", "clock", "{}"))
    deltas = [TextDelta("Checking."),
              ToolCallStart(0, "call_a", "weather"), ToolArgumentsDelta(0, '{"city": '), ToolArgumentsDelta(0, ""),
              ToolArgumentsDelta(0, '"Oslo"}'), ToolCallEnd(0),
              ToolCallStart(1, "call_b", "clock"), ToolArgumentsDelta(1, "{}"), ToolCallEnd(1)]
    request = parse(wire, tools=[WEATHER, CLOCK], stream=True)
    final_result = result("Checking.", calls=calls)
    events = streamed(wire, request, deltas, final_result)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    for index, call in ((1, calls[0]), (2, calls[1])):
        mine = [e for e in events if e.get("output_index") == index]
        added, done = mine[0]["item"], mine[-1]["item"]
        assert (added["call_id"], added["name"], added["arguments"], added["status"]) == \
            (call.id, call.name, "", "in_progress")
        deltas_text = "".join(e["delta"] for e in mine if e["type"] == "response.function_call_arguments.delta")
        assert deltas_text == call.arguments == done["arguments"]
        assert [e["arguments"] for e in mine if e["type"].endswith("arguments.done")] == [call.arguments]
        assert {e["item_id"] for e in mine[1:-1]} == {added["id"]} and done["status"] == "completed"
    # The streamed Response is the one a non-streamed request gets for the same reply.
    final = events[-1]["response"]
    whole = OpenAIResponses(MODEL).response("resp_s1", request, final_result)
    assert final["output"] == whole["output"] and final["usage"] == whole["usage"]
    assert final["status"] == "completed"


def test_a_stream_cut_by_max_output_tokens_ends_incomplete():
    wire = OpenAIResponses(MODEL)
    events = streamed(wire, parse(wire), [TextDelta("It ra")], result("It ra", finish_reason="length"))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-2]["item"]["status"] == "incomplete"
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert wire.get("resp_s1") is not None


def test_a_failure_mid_stream_is_response_failed():
    wire = OpenAIResponses(MODEL)
    stream = wire.stream("resp_f", parse(wire))
    sse = stream.start() + stream.event(TextDelta("Hal"))
    failure = APIError(504, "the request ran past the request timeout", code="request_timeout",
                       error_type="server_error")
    events = events_of(sse + stream.error(failure))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.failed"
    response = Response.model_validate(events[-1]["response"])
    assert response.status == "failed" and response.error.code == "server_error"
    assert response.error.message == failure.message and response.output[0].status == "incomplete"
    assert wire.get("resp_f") is None


def test_a_failure_before_the_stream_starts_is_an_error_event():
    wire = OpenAIResponses(MODEL)
    error = APIError(503, "overloaded", code="queue_timeout", error_type="server_overloaded")
    [event] = events_of(wire.stream("resp_e", parse(wire)).error(error))
    assert event == {"type": "error", "sequence_number": 0, "code": "queue_timeout", "message": "overloaded",
                     "param": None}


def test_a_reply_without_deltas_still_streams_its_items_in_the_final_response():
    wire = OpenAIResponses(MODEL)
    events = streamed(wire, parse(wire), [], result("ok"))
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.completed"]
    assert Response.model_validate(events[-1]["response"]).output_text == "ok"


def test_the_wire_format_protocol():
    wire = OpenAIResponses(MODEL)
    assert (wire.name, wire.id_prefix) == ("responses", "resp")
    assert "response.output_text.delta" in EVENT_MODELS and "response.reasoning_text.delta" in EVENT_MODELS


# == over loopback, through the official client ====================================================
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}},
        "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(default_model_dir):
    running = RunningServer(tiny_qwen_engine(default_model_dir))
    yield running
    running.close()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def client_stream(client: openai.OpenAI, **kwargs) -> tuple[list, Response]:
    """The SDK's own stream helper, which assembles the Response from the events as it reads them (its
    get_final_response() wants response.completed; an incomplete one is the last event's)."""
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response() if events[-1].type == "response.completed" else events[-1].response
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for event in events:
        EVENT_MODELS[event.type].model_validate(event.to_dict())
    assert [e.type for e in events][:2] == ["response.created", "response.in_progress"]
    assert events[-1].type == f"response.{final.status}"
    return events, final


def test_server_a_streamed_reply_assembles_to_the_non_streamed_one(client, server):
    fields = dict(model=server.model, instructions="Be brief.", input="Say hi.", temperature=0, max_output_tokens=12)
    whole = client.responses.create(**fields)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    events, final = client_stream(client, **fields)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert (final.status, final.usage.output_tokens) == (whole.status, whole.usage.output_tokens) == ("incomplete", 12)
    assert final.usage.input_tokens == whole.usage.input_tokens
    server.wait_idle()


def test_server_a_forced_call_streams_arguments_that_fit_the_schema(client, server):
    tool = {"type": "function", "name": "weather", "description": "The weather in a city.", "parameters": CITY}
    events, final = client_stream(client, model=server.model, input="Weather in Paris?", tools=[tool],
                                  tool_choice="required", temperature=0, max_output_tokens=80)
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls and final.status == "completed"
    for call in calls:
        assert call.name == "weather" and call.call_id
        jsonschema.validate(json.loads(call.arguments), CITY)
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.item_id == call.id]
        assert "".join(pieces) == call.arguments
    server.wait_idle()


def test_server_text_format_json_schema_constrains_the_reply(client, server):
    reply = client.responses.create(model=server.model, input="Pick a city.", temperature=0, max_output_tokens=60,
                                    text={"format": {"type": "json_schema", "name": "city", "schema": CITY}})
    assert reply.status == "completed" and reply.text.format.type == "json_schema"
    jsonschema.validate(json.loads(reply.output_text), CITY)
    server.wait_idle()


def test_server_chains_by_previous_response_id_and_retrieves_stored_responses(client, server):
    fields = dict(model=server.model, instructions="Be brief.", temperature=0, max_output_tokens=8)
    first = client.responses.create(input="Hello there.", **fields)
    assert client.responses.retrieve(first.id).to_dict() == first.to_dict()
    second = client.responses.create(input="And more.", previous_response_id=first.id, **fields)
    assert second.previous_response_id == first.id
    # Turn 2's prompt holds turn 1's, re-rendered the same bytes: the prefix cache serves it.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= 16
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(input="x", previous_response_id="resp_unknown", **fields)
    assert (info.value.code, info.value.param) == ("previous_response_not_found", "previous_response_id")
    unstored = client.responses.create(input="Forget this.", store=False, **fields)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    server.wait_idle()


BOUNDED_PATCH = {"type": "custom", "name": "apply_patch", "format": {
    "type": "grammar", "syntax": "lark",
    "definition": 'start: "*** Begin Patch" LF ("+" /[a-z"]{1,6}/ LF){1,3} "*** End Patch"\n%import common.LF\n'}}
PATCH_TEXT = re.compile(r'\*\*\* Begin Patch\n(\+[a-z"]{1,6}\n){1,3}\*\*\* End Patch')


@pytest.mark.parametrize("stream", [False, True])
def test_server_a_forced_custom_tool_writes_input_its_grammar_takes(client, server, stream):
    """hermes writes the input inside the call's JSON: the grammar, quoted, holds it there."""
    fields = dict(model=server.model, input="Patch it.", tools=[BOUNDED_PATCH, NAMESPACE], temperature=0,
                  tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=120)
    final = client_stream(client, **fields)[1] if stream else client.responses.create(**fields)
    calls = [item for item in final.output if item.type == "custom_tool_call"]
    assert final.status == "completed" and calls and all(call.name == "apply_patch" for call in calls)
    for call in calls:
        assert PATCH_TEXT.fullmatch(call.input), call.input
    server.wait_idle()


def test_server_a_forced_namespace_call_comes_back_under_its_namespace(client, server):
    final = client.responses.create(model=server.model, input="Spawn one.", tools=[NAMESPACE], temperature=0,
                                    tool_choice={"type": "function", "name": "spawn", "namespace": "agents"},
                                    max_output_tokens=120)
    calls = [item for item in final.output if item.type == "function_call"]
    assert calls and all((call.name, call.namespace) == ("spawn", "agents") for call in calls), final.output
    server.wait_idle()


def test_server_bad_tools_are_400s_and_the_server_keeps_serving(client, server):
    bad_grammar = {"type": "custom", "name": "patch",
                   "format": {"type": "grammar", "syntax": "lark", "definition": "start: missing_rule\n"}}
    for fields, param in ((dict(tools=[bad_grammar]), "tools"), (dict(max_output_tokens=0), "max_output_tokens")):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=server.model, input="x", **fields)
        assert info.value.param == param, info.value.message
    reply = client.responses.create(model=server.model, input="Still there?", max_output_tokens=4)
    assert reply.usage.output_tokens == 4
    server.wait_idle()


def test_server_max_output_tokens_past_the_context_runs_to_its_end(small_context_server):
    """What the context leaves is generated; the reply is incomplete for max_output_tokens, streamed and not."""
    server = small_context_server
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    fields = dict(model=server.model, input="Say hi.", temperature=0, max_output_tokens=32000)
    whole = client.responses.create(**fields)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 64 - whole.usage.input_tokens and whole.usage.total_tokens == 64
    _events, final = client_stream(client, **fields)
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens, whole.usage.output_tokens)
    assert final.output_text == whole.output_text
    server.wait_idle()


def test_server_an_input_that_alone_fills_the_context_is_a_400_naming_the_numbers(small_context_server):
    server = small_context_server
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=server.model, input="word " * 40, stream=stream)
        assert (info.value.param, info.value.code) == ("input", "context_length_exceeded")
        assert re.fullmatch(r"the prompt \(\d+ tokens\) leaves no room in the maximum context of 64 tokens; "
                            r"shorten it", info.value.body["message"])
    server.wait_idle()
