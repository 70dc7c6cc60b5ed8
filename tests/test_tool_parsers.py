"""Tool-call and reasoning parsers: a reply fed in any chunks gives the events and totals it gives
fed whole; calls parse in each syntax; what is not a call comes back as text."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tinymlx.text.tokenizer import Tokenizer
from tinymlx.turns.reasoning import ReasoningSplitter, starts_in_reasoning
from tinymlx.turns.tool_calls import OutputParser, syntax_for_template
from tinymlx.turns.tool_schema import typed_value
from tinymlx.turns.turn import (
    Message,
    ReasoningDelta,
    TextDelta,
    Tool,
    ToolArgumentsDelta,
    ToolCall,
    ToolCallEnd,
    ToolCallStart,
)

WEATHER = Tool("get_weather", "The weather in a city.", {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
                   "opts": {"type": "object"}, "tags": {"type": "array"}, "note": {"type": ["integer", "string"]}},
    "required": ["city"]})
TIME = Tool("get_time", "The time in a zone.", {"type": "object", "properties": {"tz": {"type": "string"}}})
TOOLS = [WEATHER, TIME]

HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ri}s <tool_call>", '
          '"days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')
HERMES_CALLS = [("get_weather", {"city": 'Pa"ri}s <tool_call>', "days": 3}), ("get_time", {"tz": "UTC"})]
XML = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork </parameter\n</parameter>\n"
       "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=opts>\n"
       '{"a": [1, "}"]}\n</parameter>\n<parameter=note>\n7\n</parameter>\n</function>\n</tool_call>\n'
       "<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
XML_CALLS = [("get_weather", {"city": "New\nYork </parameter", "days": 3, "metric": True, "opts": {"a": [1, "}"]},
                              "note": 7}), ("get_time", {})]
LLAMA3 = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris; Texas"}}; '
          '{"name": "get_time", "parameters": {"tz": "CET"}}')
LLAMA3_CALLS = [("get_weather", {"city": "Paris; Texas"}), ("get_time", {"tz": "CET"})]
REPLIES = {"hermes": (HERMES, "Let me look.", HERMES_CALLS), "xml": (XML, "Checking.", XML_CALLS),
           "llama3": (LLAMA3, "", LLAMA3_CALLS)}
CASES = [(syntax, constrained) for syntax in REPLIES for constrained in (True, False)]


def numbered_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parse(syntax, chunks, constrained=True, tools=TOOLS, **options):
    parser = OutputParser(syntax, tools, constrained=constrained, new_call_id=numbered_ids(), **options)
    events = [event for chunk in chunks for event in parser.feed(chunk)] + parser.finish()
    assert_consistent(parser, events)
    return parser, events


def assert_consistent(parser, events):
    """The events assemble to the parser's totals, and each call's come in order: start, pieces, end."""
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == parser.text
    assert ("".join(e.text for e in events if isinstance(e, ReasoningDelta)) or None) == parser.reasoning
    calls, stage = {}, {}
    for event in events:
        if isinstance(event, ToolCallStart):
            assert event.index == len(calls) and event.index not in stage
            calls[event.index], stage[event.index] = [event.id, event.name, ""], "open"
        elif isinstance(event, ToolArgumentsDelta):
            assert stage[event.index] == "open" and event.text
            calls[event.index][2] += event.text
        elif isinstance(event, ToolCallEnd):
            assert stage[event.index] == "open"
            stage[event.index] = "ended"
        else:
            assert event.text  # no empty deltas
    assert [ToolCall(*call) for call in calls.values()] == parser.tool_calls
    assert set(stage.values()) <= {"ended"}


def chunked(text, cuts):
    cuts = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(cuts)]


def outcome(parser):
    return parser.text, parser.reasoning, [(c.name, json.loads(c.arguments)) for c in parser.tool_calls]


@pytest.mark.parametrize(("syntax", "constrained"), CASES)
def test_a_reply_with_two_calls_parses_in_each_syntax(syntax, constrained):
    reply, text, calls = REPLIES[syntax]
    parser, events = parse(syntax, [reply], constrained)
    assert outcome(parser) == (text, None, calls)
    assert [c.id for c in parser.tool_calls] == ["call_0", "call_1"]
    assert not any("<tool_call>" in e.text or "<function" in e.text for e in events if isinstance(e, TextDelta))


@pytest.mark.parametrize(("syntax", "constrained"), CASES)
def test_every_split_point_gives_the_unsplit_result(syntax, constrained):
    reply = REPLIES[syntax][0]
    whole, _ = parse(syntax, [reply], constrained)
    for cut in range(len(reply) + 1):
        parser, _ = parse(syntax, [reply[:cut], reply[cut:]], constrained)
        assert (parser.text, parser.reasoning, parser.tool_calls) == (whole.text, whole.reasoning, whole.tool_calls)
    one_by_one, _ = parse(syntax, list(reply), constrained)
    assert one_by_one.tool_calls == whole.tool_calls


@given(st.sampled_from(CASES), st.lists(st.integers(min_value=0), max_size=12), st.booleans())
def test_any_chunks_give_the_unsplit_result(case, cuts, thinks):
    syntax, constrained = case
    reply = ("<think>\nWhich tool?\n</think>\n\n" if thinks else "") + REPLIES[syntax][0]
    whole, _ = parse(syntax, [reply], constrained)
    parser, _ = parse(syntax, chunked(reply, cuts), constrained)
    assert (parser.text, parser.reasoning, parser.tool_calls) == (whole.text, whole.reasoning, whole.tool_calls)
    assert parser.reasoning == ("Which tool?" if thinks else None)


FRAGMENTS = ["```json\n", "```", "<tool_call>", "</tool_call>", "<think>", "</think>", "\n", " ", "<function=get_time>", "</function>",
             "<parameter=tz>", "</parameter>", '{"name": "get_time", "arguments": ', '"parameters": ', "{", "}",
             '"', "\\", ";", "<|python_tag|>", "[", '"tz": "UTC"', "NaN", "<tool", "_call>", "x"]


@given(st.sampled_from(CASES), st.lists(st.sampled_from(FRAGMENTS), max_size=30),
       st.lists(st.integers(min_value=0), max_size=8), st.booleans())
def test_any_text_parses_without_error_and_chunks_do_not_matter(case, fragments, cuts, starts_inside):
    syntax, constrained = case  # constrained: text the grammar would never allow, still no error
    reply = "".join(fragments)
    whole, _ = parse(syntax, [reply], constrained, starts_in_reasoning=starts_inside)
    parser, _ = parse(syntax, chunked(reply, cuts), constrained, starts_in_reasoning=starts_inside)
    assert (parser.text, parser.reasoning, parser.tool_calls) == (whole.text, whole.reasoning, whole.tool_calls)
    for call in whole.tool_calls if not constrained else ():
        assert isinstance(json.loads(call.arguments), dict)  # unconstrained, only valid calls are calls


def test_constrained_arguments_stream_as_they_arrive():
    parser = OutputParser("hermes", TOOLS, constrained=True, new_call_id=numbered_ids())
    assert parser.feed('<tool_call>\n{"name": "get_weather", "arguments": ') == []
    assert parser.feed('{"city": "Pa') == [ToolCallStart(0, "call_0", "get_weather"),
                                             ToolArgumentsDelta(0, '{"city": "Pa')]
    assert parser.feed('ris"}}\n</tool') == [ToolArgumentsDelta(0, 'ris"}')]
    assert parser.feed("_call>") == [ToolCallEnd(0)]
    xml = OutputParser("xml", TOOLS, constrained=True, new_call_id=numbered_ids())
    assert xml.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar") == [
        ToolCallStart(0, "call_0", "get_weather"), ToolArgumentsDelta(0, '{"city": "Par')]
    assert xml.feed("is\n</param") == [ToolArgumentsDelta(0, "is")]  # the newline may be the tag's
    assert xml.feed("eter>\n</function>\n</tool_call>") == [ToolArgumentsDelta(0, '"}'), ToolCallEnd(0)]


def test_text_streams_at_once_holding_back_only_a_possible_tag():
    parser = OutputParser("hermes", TOOLS, constrained=True, new_call_id=numbered_ids())
    assert parser.feed("Hello <tool") == [TextDelta("Hello")]  # " <tool" may open a call
    assert parser.feed("box> here") == [TextDelta(" <toolbox> here")]
    assert parser.finish() == []


@pytest.mark.parametrize("bad", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',  # a brace short
    '<tool_call>\n{"name": "send_mail", "arguments": {}}\n</tool_call>',  # no such tool
    '<tool_call>\n{"name": "get_weather", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>\nnot json at all\n</tool_call>'])
def test_malformed_calls_under_auto_are_text(bad):
    for chunks in ([f"Sure.\n{bad} Done."], list(f"Sure.\n{bad} Done.")):
        parser, events = parse("hermes", chunks, constrained=False)
        assert (parser.text, parser.tool_calls) == (f"Sure.\n{bad} Done.", [])


def test_a_good_call_after_a_malformed_one_still_parses():
    reply = '<tool_call>\n{"name": "get_time", "arguments": {"tz": }\n</tool_call>\n' + HERMES.split("\n", 1)[1]
    parser, _ = parse("hermes", [reply], constrained=False)
    assert parser.text.startswith("<tool_call>\n{") and len(parser.tool_calls) == 2


def test_an_unterminated_call_is_text_unconstrained_and_ends_constrained():
    cut = HERMES[: HERMES.index('"days"')]
    parser, _ = parse("hermes", [cut], constrained=False)
    assert (parser.text, parser.tool_calls) == (cut, [])
    parser, events = parse("hermes", [cut], constrained=True)  # max_tokens: the call ends as it is
    assert parser.text == "Let me look."
    assert parser.tool_calls[0].arguments == '{"city": "Pa\\"ri}s <tool_call>", '
    assert events[-1] == ToolCallEnd(0)


def test_one_call_only_without_parallel_tool_calls():
    for constrained in (True, False):
        parser, _ = parse("hermes", [HERMES], constrained, parallel_tool_calls=False)
        assert [c.name for c in parser.tool_calls] == ["get_weather"] and parser.text == "Let me look."


def test_xml_values_are_typed_by_the_schema():
    assert typed_value("Paris", {"type": "string"}) == "Paris"
    assert typed_value("3", {"type": "string"}) == "3"
    assert typed_value("3", {"type": "integer"}) == 3
    assert typed_value("3.0", {"type": "integer"}) == 3
    assert typed_value("2.5", {"type": "number"}) == 2.5
    assert typed_value("true", {"type": "boolean"}) is True
    assert typed_value("False", {"type": "boolean"}) is False  # Qwen3-Coder's template writes Python's
    assert typed_value('{"a": 1}', {"type": "object"}) == {"a": 1}
    assert typed_value("[1, 2]", {"type": "array"}) == [1, 2]
    assert typed_value("three", {"type": "integer"}) == "three"  # not JSON of the type: the string
    assert typed_value("[1", {"type": "array"}) == "[1"
    assert typed_value("7", {"type": ["integer", "string"]}) == 7
    assert typed_value("x", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == "x"
    assert typed_value("42", None) == "42"  # a parameter the schema does not know stays text
    assert typed_value("null", {"type": "null"}) is None
    assert typed_value("NaN", {"type": "number"}) == "NaN"  # not JSON


def test_xml_parameters_given_by_reference_are_typed_by_what_they_refer_to():
    counted = Tool("count", "", {"type": "object", "properties": {"n": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": "integer"}}})
    reply = "<tool_call>\n<function=count>\n<parameter=n>\n4\n</parameter>\n</function>\n</tool_call>"
    for constrained in (True, False):
        assert json.loads(parse("xml", [reply], constrained, tools=[counted])[0].tool_calls[0].arguments) == {"n": 4}


def test_xml_unconstrained_types_values_and_tolerates_missing_newlines():
    reply = ("<tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n"
             "<parameter=days>\nseven\n</parameter>\n</function>\n</tool_call>")
    parser, _ = parse("xml", [reply], constrained=False)
    assert json.loads(parser.tool_calls[0].arguments) == {"city": "Paris", "days": "seven"}


def test_llama3_calls_and_text():
    parser, _ = parse("llama3", ['  {"name": "get_time", "parameters": {"tz": "UTC"}}'], constrained=False)
    assert outcome(parser) == ("", None, [("get_time", {"tz": "UTC"})])
    for text in ["It is sunny {not a call}", "{oops}"]:
        for constrained in (True, False):
            parser, _ = parse("llama3", list(text), constrained)
            assert (parser.text, parser.tool_calls) == (text, []), (text, constrained)
    cut = '{"name": "get_time", "parameters": {"tz": "UTC"}'  # the call object never closes
    assert outcome(parse("llama3", list(cut), constrained=False)[0]) == (cut, None, [])
    assert outcome(parse("llama3", list(cut), constrained=True)[0]) == ("", None, [("get_time", {"tz": "UTC"})])


# Qwen2.5-Coder's untagged calls under "auto" (temperature 0): 0.5B bare, 1.5B fenced and pretty-printed.
UNTAGGED_05B = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
UNTAGGED_15B = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'


@pytest.mark.parametrize("reply", [UNTAGGED_05B, UNTAGGED_15B, "\n```\n" + UNTAGGED_05B + "\n```\n"])
@pytest.mark.parametrize("constrained", [True, False])
def test_an_untagged_call_opening_the_reply_is_a_call_at_every_split_point(reply, constrained):
    for chunks in ([reply[:cut], reply[cut:]] for cut in range(len(reply) + 1)):
        parser, events = parse("hermes", chunks, constrained)
        assert outcome(parser) == ("", None, [("get_weather", {"city": "Paris"})])
        assert not [e for e in events if isinstance(e, TextDelta)]  # the fence and the call's braces included
    parser, _ = parse("hermes", list(reply), constrained)
    assert outcome(parser) == ("", None, [("get_weather", {"city": "Paris"})])
    # Under the grammar the arguments stream as the model wrote them; checked whole, they are re-encoded.
    assert parser.tool_calls[0].arguments == ('{\n    "city": "Paris"\n  }' if constrained and "  " in reply
                                              else '{"city": "Paris"}')


def test_an_untagged_call_streams_once_its_name_is_read():
    parser = OutputParser("hermes", TOOLS, constrained=True, new_call_id=numbered_ids())
    assert parser.feed("```json\n{\n") == []
    assert parser.feed('  "name": "get_weather",\n  "arguments": ') == []
    assert parser.feed('{\n    "city": "Pa') == [ToolCallStart(0, "call_0", "get_weather"),
                                                ToolArgumentsDelta(0, '{\n    "city": "Pa')]
    assert parser.feed('ris"\n  }\n}') == [ToolArgumentsDelta(0, 'ris"\n  }'), ToolCallEnd(0)]
    assert parser.feed("\n```") == [] and parser.finish() == []
    assert parser.text == ""


@pytest.mark.parametrize("reply", [
    "```python\nprint(1)\n```", '{"foo": 1}', '```json\n{"names": [1]}\n```', "```",
    'You could call {"name": "get_weather", "arguments": {"city": "Paris"}} for that.',
    'Sure.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'])
@pytest.mark.parametrize("constrained", [True, False])
def test_a_reply_not_opening_as_an_untagged_call_is_text(reply, constrained):
    for chunks in ([reply], list(reply)):
        parser, _ = parse("hermes", chunks, constrained)
        assert (parser.text, parser.tool_calls) == (reply, [])


@pytest.mark.parametrize("reply", [
    UNTAGGED_05B + " Done.", UNTAGGED_15B + "\nDone.", UNTAGGED_05B + "\n" + UNTAGGED_05B,
    UNTAGGED_05B.replace("get_weather", "send_mail"), UNTAGGED_05B.replace('{"city": "Paris"}', "[1]"),
    '{"name": "get_weather", "arguments": {"city": "Paris"}', '{"name" is the key.', UNTAGGED_15B[:-4] + "``"])
def test_unconstrained_an_untagged_call_must_be_the_whole_reply(reply):
    for chunks in ([reply], list(reply)):
        parser, _ = parse("hermes", chunks, constrained=False)
        assert (parser.text, parser.tool_calls) == (reply, [])


def test_unconstrained_an_untagged_call_may_lack_its_closing_fence():
    parser, _ = parse("hermes", [UNTAGGED_15B.removesuffix("```")], constrained=False)
    assert outcome(parser) == ("", None, [("get_weather", {"city": "Paris"})])


def test_reasoning_splits_across_chunks_and_drops_the_tags_newlines():
    reply = "<think>\nStep 1.\nStep 2.\n</think>\n\nThe answer."
    for cut in range(len(reply) + 1):
        for chunks in ([reply[:cut], reply[cut:]], list(reply)):
            splitter = ReasoningSplitter(starts_inside=False)
            pieces = [p for chunk in chunks for p in splitter.feed(chunk)] + splitter.finish()
            assert "".join(p.text for p in pieces if isinstance(p, ReasoningDelta)) == "Step 1.\nStep 2."
            assert "".join(p.text for p in pieces if isinstance(p, TextDelta)) == "The answer."


def test_reasoning_the_prompt_opened():
    parser, _ = parse(None, list("Hmm.\n</think>\n\nHi <think>x</think>"), starts_in_reasoning=True)
    assert (parser.reasoning, parser.text) == ("Hmm.", "Hi <think>x</think>")  # later tags are text
    parser, _ = parse(None, ["<think>\nagain\n</think>\nok"], starts_in_reasoning=True)  # a repeated <think>
    assert (parser.reasoning, parser.text) == ("again", "ok")
    parser, _ = parse(None, ["cut short\n"], starts_in_reasoning=True)
    assert (parser.reasoning, parser.text) == ("cut short", "")
    parser, _ = parse(None, ["<thin", "king> is a word"], starts_in_reasoning=False)
    assert (parser.reasoning, parser.text) == (None, "<thinking> is a word")
    parser, _ = parse(None, ["<think>\n\n</think>\n\nplain"])
    assert (parser.reasoning, parser.text) == (None, "plain")


def test_reasoning_ends_where_an_xml_call_opens_without_closing_it():
    reply = "I will call it.\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
    parser, _ = parse("xml", list(reply), constrained=False, starts_in_reasoning=True)
    assert (parser.reasoning, parser.text, [c.name for c in parser.tool_calls]) == ("I will call it.", "", ["get_time"])


def test_starts_in_reasoning_reads_the_generation_prompt():
    assert starts_in_reasoning("<|im_start|>assistant\n<think>\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking=False
    assert not starts_in_reasoning("<|im_start|>user\n<think> me</think><|im_end|>\n<|im_start|>assistant\n")
    assert not starts_in_reasoning("<|im_start|>assistant\n")


QWEN3_CODER = """{%- if tools %}{{- "You have access to the following functions:\\n\\n<tools>" }}{%- endif %}
{{- '\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n<tool_call>\\n'
    '<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n'
    '</tool_call>' }}"""
LLAMA31 = """{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
{%- if builtin_tools is defined %}{{- '<|python_tag|>' + tool_call.name + '.call(' }}{%- endif %}"""
LLAMA32 = """{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{{- '{"name": "' + tool_call.name + '", ' }}{{- '"parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}" }}"""
CHATML = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n'}}{% endfor %}"


def test_syntax_for_template(default_model_dir):
    qwen25 = json.loads((default_model_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert syntax_for_template(qwen25) == "hermes"
    assert syntax_for_template(QWEN3_CODER) == "xml"
    assert syntax_for_template(LLAMA31) == "llama3"
    assert syntax_for_template(LLAMA32) == "llama3"
    assert syntax_for_template(CHATML) is None
    assert syntax_for_template(None) is None


def test_a_parsed_reply_renders_back_to_the_bytes_the_model_wrote(default_model_dir):
    """What the prefix cache needs across turns: the next prompt holds this reply as it was generated."""
    tokenizer = Tokenizer.from_dir(default_model_dir)
    reply = ('I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>')
    history = [{"role": "user", "content": "Weather and time?"}]
    tools = [tool.template_dict() for tool in TOOLS]
    prompt = tokenizer.render_chat(history, add_generation_prompt=True, tools=tools)
    for constrained in (True, False):
        parser, _ = parse("hermes", list(reply), constrained)
        message = Message("assistant", parser.text, tool_calls=tuple(parser.tool_calls)).template_dict()
        rendered = tokenizer.render_chat([*history, message], add_generation_prompt=False, tools=tools)
        assert rendered == prompt + reply + "<|im_end|>\n"
