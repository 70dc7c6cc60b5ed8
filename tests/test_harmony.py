"""gpt-oss's harmony format: the reply's channels read once (turns/harmony.py) and shared by chat completions,
Messages, Responses and the chat UI; the call grammar of harmony; reasoning_effort reaching the template.

The model is a tiny gpt-oss behind a byte-level tokenizer with harmony's control tokens (harmony_model.py):
its text is noise, so each server test scripts its reply as a grammar, and checks the script is a reply the
server's own call grammar accepts."""

from __future__ import annotations

import dataclasses
import json

import anthropic
import openai
import pytest
from harmony_model import accepts, as_grammar, harmony_engine, harmony_model_dir, scripted
from server_harness import RunningServer

from tinymlx.text.tokenizer import Tokenizer
from tinymlx.turns.reply_format import ReplyFormat
from tinymlx.turns.tool_calls import OutputParser
from tinymlx.turns.tool_grammar import call_grammar
from tinymlx.turns.turn import (
    ReasoningDelta,
    TextDelta,
    Tool,
    ToolArgumentsDelta,
    ToolCall,
    ToolCallEnd,
    ToolCallStart,
)

WEATHER = Tool("get_weather", "The weather in a city.",
               {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TIME = Tool("get_time", "The time.", {"type": "object", "properties": {}})
TOOLS = (WEATHER, TIME)

ANALYSIS = "<|channel|>analysis<|message|>17 has no divisor but 1 and itself.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Yes, 17 is prime.<|return|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city": "Paris"}<|call|>')


def numbered_ids():
    count = iter(range(100))
    return lambda: f"call_{next(count)}"


def parse(text: str, cuts: list[int] | None = None, constrained: bool = False, **options) -> OutputParser:
    parser = OutputParser("harmony", TOOLS, constrained=constrained, new_call_id=numbered_ids(), **options)
    bounds = [0, *(cuts if cuts is not None else range(1, len(text))), len(text)]
    parser.events = [e for a, b in zip(bounds, bounds[1:]) for e in parser.feed(text[a:b])] + parser.finish()
    return parser


# -- the reader ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("constrained", [False, True])
def test_analysis_is_reasoning_and_final_is_the_answer(constrained):
    parser = parse(ANALYSIS + FINAL, constrained=constrained)
    assert parser.reasoning == "17 has no divisor but 1 and itself."
    assert parser.text == "Yes, 17 is prime." and parser.tool_calls == []
    kinds = [type(e) for e in parser.events]  # reasoning streams first, then the answer, piece by piece
    assert kinds.index(TextDelta) > max(i for i, k in enumerate(kinds) if k is ReasoningDelta)
    assert len(kinds) == len("17 has no divisor but 1 and itself.") + len("Yes, 17 is prime.")


@pytest.mark.parametrize("constrained", [False, True])
@pytest.mark.parametrize("header", [
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
    "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>",  # recipient first
])
def test_a_call_in_commentary_is_a_tool_call_whatever_the_chunks(constrained, header):
    reply = ANALYSIS + header + '{"city": "Paris"}<|call|>'
    whole = parse(reply, cuts=[], constrained=constrained)
    assert whole.tool_calls == [ToolCall("call_0", "get_weather", '{"city": "Paris"}')]
    assert whole.reasoning == "17 has no divisor but 1 and itself." and whole.text == ""
    for cuts in (None, [5, 6, 60, 61, len(reply) - 12, len(reply) - 3], [len(ANALYSIS) + len(header) - 4]):
        split = parse(reply, cuts, constrained=constrained)  # a call split across chunks, markup cut in two
        assert (split.tool_calls, split.reasoning, split.text) == (whole.tool_calls, whole.reasoning, whole.text)
    streamed = parse(reply, constrained=constrained).events
    if constrained:  # the arguments stream as they arrive, between the call's start and end
        start = streamed.index(ToolCallStart(0, "call_0", "get_weather"))
        assert streamed[-1] == ToolCallEnd(0)
        assert all(isinstance(e, ToolArgumentsDelta) for e in streamed[start + 1:-1])
        assert len(streamed) - start - 2 == len('{"city": "Paris"}')


@pytest.mark.parametrize("body", ['{"city": "Par', '{"city": "Paris"} trailing', "[1, 2]", "NaN"])
def test_malformed_arguments_under_auto_come_back_as_text(body):
    parser = parse(ANALYSIS + CALL.replace('{"city": "Paris"}', body))
    assert parser.tool_calls == [] and parser.text == body
    assert parser.reasoning == "17 has no divisor but 1 and itself."


def test_unknown_tools_preambles_and_plain_text_are_text():
    unknown = parse(CALL.replace("functions.get_weather", "functions.launch"))
    assert (unknown.tool_calls, unknown.text) == ([], '{"city": "Paris"}')
    builtin = parse(CALL.replace("functions.get_weather", "browser.search"))
    assert (builtin.tool_calls, builtin.text) == ([], '{"city": "Paris"}')
    preamble = parse("<|channel|>commentary<|message|>Looking it up.<|end|>" + CALL)
    assert preamble.text == "Looking it up." and [c.name for c in preamble.tool_calls] == ["get_weather"]
    plain = parse("Just words, no markup.")  # a model that skips the markup loses nothing
    assert (plain.text, plain.reasoning) == ("Just words, no markup.", None)
    cut = parse(ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Yes, 17")  # max_tokens mid-answer
    assert cut.text == "Yes, 17"


def test_a_constrained_call_cut_short_still_ends():
    parser = parse(CALL[:-len('"}<|call|>')], constrained=True)
    assert parser.tool_calls == [ToolCall("call_0", "get_weather", '{"city": "Paris')]
    assert parser.events[-1] == ToolCallEnd(0)


def test_calls_past_the_first_are_dropped_when_not_parallel():
    second = CALL.replace("get_weather", "get_time").replace('{"city": "Paris"}', "{}")
    parser = parse(CALL.replace("<|call|>", "<|end|>") + second, parallel_tool_calls=False)
    assert [c.name for c in parser.tool_calls] == ["get_weather"] and parser.text == ""


# -- the call grammar ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return harmony_model_dir(tmp_path_factory.mktemp("harmony") / "m")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


def test_the_call_grammar_holds_each_tool_choice(tokenizer):
    required = call_grammar("harmony", TOOLS, "required", True)
    assert accepts(tokenizer, required, CALL) and accepts(tokenizer, required, ANALYSIS + CALL)
    assert not accepts(tokenizer, required, ANALYSIS + FINAL)  # required: the reply must call
    assert not accepts(tokenizer, required, CALL.replace('"Paris"', "7"))  # the arguments fit the schema
    named = call_grammar("harmony", TOOLS, "get_time", True)
    assert not accepts(tokenizer, named, CALL)
    assert accepts(tokenizer, named, CALL.replace("get_weather", "get_time").replace('{"city": "Paris"}', "{}"))
    auto = call_grammar("harmony", TOOLS, "auto", True)
    preamble = "<|channel|>commentary<|message|>Looking.<|end|>"
    for reply in (ANALYSIS + FINAL, ANALYSIS + CALL, FINAL, preamble + "<|start|>assistant" + CALL[len("<|start|>assistant"):]):
        assert accepts(tokenizer, auto, reply), reply
    assert not accepts(tokenizer, auto, CALL.replace("get_weather", "launch"))
    assert not accepts(tokenizer, auto, CALL.replace('{"city": "Paris"}', '{"city": "Par'))


# -- through the three APIs ---------------------------------------------------------------------------
@pytest.fixture
def server(model_dir):
    running = RunningServer(harmony_engine(model_dir))
    yield running
    running.close()


CHAT_TOOLS = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                 "parameters": t.parameters}} for t in TOOLS]
ANTHROPIC_TOOLS = [{"name": t.name, "description": t.description, "input_schema": t.parameters} for t in TOOLS]
RESPONSES_TOOLS = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters}
                   for t in TOOLS]
USER = [{"role": "user", "content": "Is 17 prime?"}]


def chat_reply(client: openai.OpenAI, server: RunningServer, stream: bool, **body):
    """(reasoning, content, tool calls as (name, arguments), finish reason) of a chat completion."""
    request = dict(model=server.model, messages=USER, max_tokens=200, **body)
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return ((choice.message.model_extra or {}).get("reasoning_content"), choice.message.content, calls,
                choice.finish_reason)
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for call in delta.tool_calls or []:
            name, arguments = calls.get(call.index, ("", ""))
            calls[call.index] = (name + (call.function.name or ""), arguments + (call.function.arguments or ""))
        finish = chunk.choices[0].finish_reason or finish
    return reasoning or None, content or None, list(calls.values()), finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_completions_split_reasoning_answer_and_calls(server, stream):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    asked = scripted(server.engine, as_grammar(ANALYSIS + FINAL))
    assert chat_reply(client, server, stream) == ("17 has no divisor but 1 and itself.", "Yes, 17 is prime.", [],
                                                  "stop")
    assert asked[-1].grammar is None and asked[-1].skip_special_tokens is False  # markup kept for the reader
    asked = scripted(server.engine, as_grammar(ANALYSIS + CALL))
    reply = chat_reply(client, server, stream, tools=CHAT_TOOLS, tool_choice="required")
    assert reply == ("17 has no divisor but 1 and itself.", None, [("get_weather", '{"city": "Paris"}')],
                     "tool_calls")
    assert accepts(server.engine.tokenizer, asked[-1].grammar, ANALYSIS + CALL)  # the server's grammar allows it
    assert not accepts(server.engine.tokenizer, asked[-1].grammar, ANALYSIS + FINAL)
    server.wait_idle()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_messages_give_thinking_text_and_tool_use_blocks(server, stream):
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)

    def blocks(**body) -> list[tuple]:
        request = dict(model=server.model, messages=USER, max_tokens=200, **body)
        if stream:
            with client.messages.stream(**request) as events:
                message = events.get_final_message()
        else:
            message = client.messages.create(**request)
        return [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None) or (b.name, b.input))
                for b in message.content] + [message.stop_reason]

    scripted(server.engine, as_grammar(ANALYSIS + FINAL))
    assert blocks() == [("thinking", "17 has no divisor but 1 and itself."), ("text", "Yes, 17 is prime."),
                        "end_turn"]
    scripted(server.engine, as_grammar(ANALYSIS + CALL))
    assert blocks(tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}) == [
        ("thinking", "17 has no divisor but 1 and itself."), ("tool_use", ("get_weather", {"city": "Paris"})),
        "tool_use"]
    server.wait_idle()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_give_reasoning_message_and_function_call_items(server, stream):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)

    def items(**body) -> list[tuple]:
        request = dict(model=server.model, input="Is 17 prime?", max_output_tokens=200, store=False, **body)
        if stream:
            with client.responses.stream(**request) as events:
                response = events.get_final_response()
        else:
            response = client.responses.create(**request)
        out = []
        for item in response.output:
            if item.type == "reasoning":
                out.append(("reasoning", item.content[0].text))
            elif item.type == "message":
                out.append(("message", item.content[0].text))
            else:
                out.append((item.type, item.name, json.loads(item.arguments)))
        return out

    scripted(server.engine, as_grammar(ANALYSIS + FINAL))
    assert items() == [("reasoning", "17 has no divisor but 1 and itself."), ("message", "Yes, 17 is prime.")]
    scripted(server.engine, as_grammar(ANALYSIS + CALL))
    assert items(tools=RESPONSES_TOOLS, tool_choice="required") == [
        ("reasoning", "17 has no divisor but 1 and itself."), ("function_call", "get_weather", {"city": "Paris"})]
    server.wait_idle()


def test_a_tool_round_trip_renders_the_call_and_its_result(server):
    """The call sent back renders as the model wrote it (recipient, channel, JSON) and the result as the tool's
    message to the assistant: the next prompt's tokens are checked against the template's own rendering."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    scripted(server.engine, as_grammar(ANALYSIS + FINAL))
    history = USER + [
        {"role": "assistant", "content": None, "reasoning_content": "Need the weather.",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    usage = client.chat.completions.create(model=server.model, messages=history, tools=CHAT_TOOLS,
                                           max_tokens=200).usage
    rendered = server.engine.tokenizer.render_chat(
        [{"role": "user", "content": "Is 17 prime?"}, {"role": "assistant", "content": "", "thinking": "Need the weather.",
          "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "name": "get_weather", "content": "sunny"}], tools=CHAT_TOOLS)
    assert ("<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant "
            'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>') in rendered
    assert usage.prompt_tokens == len(server.engine.tokenizer.encode(rendered, add_special_tokens=False))
    server.wait_idle()


def test_reasoning_effort_reaches_the_template_from_every_api(server):
    chat = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    messages = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    scripted(server.engine, as_grammar(FINAL))

    def prompt_tokens(effort: str) -> tuple[int, int, int]:
        return (chat.chat.completions.create(model=server.model, messages=USER, max_tokens=50,
                                             reasoning_effort=effort).usage.prompt_tokens,
                chat.responses.create(model=server.model, input=USER, max_output_tokens=50, store=False,
                                      reasoning={"effort": effort}).usage.input_tokens,
                messages.messages.count_tokens(model=server.model, messages=USER,
                                               extra_body={"output_config": {"effort": effort}}).input_tokens)

    low, high = prompt_tokens("low"), prompt_tokens("high")
    assert all(h - lo == len("high") - len("low") for lo, h in zip(low, high)), (low, high)  # one byte-token each
    assert "Reasoning: high" in server.engine.tokenizer.render_chat(USER, reasoning_effort="high")
    # An effort no API has is a 400 naming the field, and nothing is queued.
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        chat.chat.completions.create(model=server.model, messages=USER, max_tokens=5, reasoning_effort="extreme")
    with pytest.raises(anthropic.BadRequestError, match="effort"):
        messages.messages.create(model=server.model, messages=USER, max_tokens=5,
                                 extra_body={"output_config": {"effort": "extreme"}})
    server.wait_idle()


def test_the_chat_ui_reads_harmony_with_the_same_parser(model_dir):
    from tinymlx_ui.reply_parts import ReplyParts

    reply_format = ReplyFormat.of_template(Tokenizer.from_dir(model_dir).chat_template_source)
    assert reply_format == ReplyFormat("harmony", thinks=True, keeps_markup=True)
    parts = ReplyParts(reply_format)
    for at in range(0, len(ANALYSIS), 7):
        parts.feed(ANALYSIS[at:at + 7])
    assert (parts.reasoning, parts.answer) == ("17 has no divisor but 1 and itself.", "")  # thinking, live
    parts.feed(FINAL)
    parts.finish()
    assert (parts.reasoning, parts.answer) == ("17 has no divisor but 1 and itself.", "Yes, 17 is prime.")


def test_tinymlx_generate_prints_the_answer_and_sends_the_analysis_to_stderr(model_dir, monkeypatch, capsys):
    from tinymlx import cli
    from tinymlx.engine.engine import Engine

    add_request = Engine.add_request
    monkeypatch.setattr(Engine, "add_request", lambda self, prompt, params, *args, **kwargs: add_request(
        self, prompt, dataclasses.replace(params, grammar=as_grammar(ANALYSIS + FINAL)), *args, **kwargs))
    cli.main(["generate", "--model", str(model_dir), "--dtype", "float32", "--max-tokens", "200", "Is 17 prime?"])
    out, err = capsys.readouterr()
    assert out == "Yes, 17 is prime.\n"
    assert "17 has no divisor but 1 and itself." in err and "<|channel|>" not in out + err
