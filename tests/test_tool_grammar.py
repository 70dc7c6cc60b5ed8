"""Call grammars on the real Qwen2.5 tokenizer: a matcher (the engine's StructuredOutput) takes a valid
call's tokens and may end after it, refuses an invalid one, and the parser reads what it accepts."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tinymlx.core.sampling_params import Constraint
from tinymlx.sample.structured import StructuredOutput
from tinymlx.text.tokenizer import Tokenizer
from tinymlx.turns.tool_calls import OutputParser
from tinymlx.turns.tool_grammar import call_grammar, check_tools, markup_tokens
from tinymlx.turns.turn import Freeform, TextDelta, Tool

WEATHER = Tool("get_weather", "The weather in a city.", {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1},
                   "unit": {"enum": ["c", "f"]}, "opts": {"type": "object", "properties": {"a": {"type": "boolean"}}},
                   "note": {"type": ["integer", "string"]}},
    "required": ["city"]})
TIME = Tool("get_time", "The time in a zone.", {"type": "object", "properties": {"tz": {"$ref": "#/$defs/zone"}},
                                                 "required": ["tz"], "$defs": {"zone": {"enum": ["UTC", "CET"]}}})
TOOLS = [WEATHER, TIME]

HERMES_WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
HERMES_TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
XML_WEATHER = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
               "</parameter>\n<parameter=unit>\nc\n</parameter>\n<parameter=opts>\n{\"a\": true}\n</parameter>\n"
               "<parameter=note>\nwarm </parameter> or not\n</parameter>\n</function>\n</tool_call>")
XML_TIME = "<tool_call>\n<function=get_time>\n<parameter=tz>\nUTC\n</parameter>\n</function>\n</tool_call>"
# Qwen2.5-Coder's untagged calls under "auto" (temperature 0): 0.5B bare, 1.5B fenced and pretty-printed.
UNTAGGED_05B = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
UNTAGGED_15B = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
LLAMA3_WEATHER = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
LLAMA3_TIME = '{"name": "get_time", "parameters": {"tz": "CET"}}'


@pytest.fixture(scope="session")
def qwen(default_model_dir):
    tokenizer = Tokenizer.from_dir(default_model_dir)
    return tokenizer, StructuredOutput(tokenizer.to_json(), tokenizer.eos_token_ids, tokenizer.vocab_size)


def matched(qwen, grammar, text=None, token_ids=None):
    """"stopped" (the grammar is complete), "can end" (EOS allowed next), "open", or where it refused."""
    tokenizer, structured = qwen
    token_ids = tokenizer.encode(text, add_special_tokens=False) if token_ids is None else token_ids
    structured.add(0, Constraint("grammar", grammar))
    try:
        for i, token in enumerate(token_ids):
            try:
                if structured.advance(0, token):
                    return "stopped" if i == len(token_ids) - 1 else f"stopped before {tokenizer.decode(token_ids[i + 1:])!r}"
            except RuntimeError:
                return f"refused {tokenizer.decode(token_ids[: i + 1], skip_special_tokens=False)[-24:]!r}"
        mask = structured.row_masks([(0, 0, [])]).bitmask[0]
        im_end = tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]
        return "can end" if (int(mask[im_end // 32]) >> (im_end % 32)) & 1 else "open"
    finally:
        structured.forget(0)


def test_tool_call_is_one_non_special_token_that_llguidance_names(qwen):
    tokenizer, structured = qwen
    assert tokenizer.encode("<tool_call>", add_special_tokens=False) == [151657]
    assert tokenizer.encode("</tool_call>", add_special_tokens=False) == [151658]
    # Not special to Hugging Face: decoding keeps it, so the parser sees it in the text...
    assert tokenizer.decode([151657], skip_special_tokens=True) == "<tool_call>"
    # ...but every added token is special to llguidance: a Lark string "<tool_call>" never matches it.
    assert structured.tokenizer.is_special_token(151657)
    assert markup_tokens(tokenizer) == {"<tool_call>", "</tool_call>"}  # no <think> in Qwen2.5


CASES = [
    ("hermes", "required", True, HERMES_WEATHER, "can end"),
    ("hermes", "required", True, HERMES_WEATHER + "\n" + HERMES_TIME + "\n", "can end"),
    ("hermes", "required", False, HERMES_WEATHER, "stopped"),
    ("hermes", "required", False, HERMES_WEATHER + "\n" + HERMES_TIME, "stopped before '\\n<tool_call>"),
    ("hermes", "required", True, "Sure." + HERMES_WEATHER, "refused 'Sure'"),
    ("hermes", "required", True, HERMES_WEATHER.replace("3", '"3"'), "refused"),
    ("hermes", "required", True, HERMES_WEATHER.replace("3", "0"), "refused"),  # minimum 1
    ("hermes", "required", True, HERMES_TIME.replace("UTC", "PST"), "refused"),  # the $ref'd enum
    ("hermes", "required", True, HERMES_WEATHER.replace("get_weather", "get_wea"), "refused"),
    ("hermes", "auto", True, "No tool needed.", "can end"),
    ("hermes", "auto", True, "Let me check.\n" + HERMES_WEATHER + "\n" + HERMES_TIME, "can end"),
    ("hermes", "auto", True, HERMES_WEATHER + " and more text", "refused"),
    ("hermes", "auto", True, "Hi " + HERMES_WEATHER.replace('"city"', '"town"'), "refused"),
    ("hermes", "get_time", True, HERMES_TIME, "stopped"),
    ("hermes", "get_time", True, HERMES_WEATHER, "refused"),
    ("xml", "required", True, XML_WEATHER + "\n" + XML_TIME, "can end"),
    ("xml", "auto", True, "On it. " + XML_TIME, "can end"),
    ("xml", "get_weather", True, XML_TIME, "refused"),
    ("xml", "get_time", True, XML_TIME.replace("UTC", "PST"), "refused"),  # the $ref'd enum
    ("xml", "required", True, XML_WEATHER.replace("\nc\n", "\nkelvin\n"), "refused"),
    ("xml", "required", True, XML_WEATHER.replace("\n3\n", "\nthree\n"), "refused"),
    ("xml", "required", True, XML_TIME.replace("<parameter=tz>\nUTC\n</parameter>\n", ""), "refused"),  # required
    ("hermes", "auto", True, "  " + UNTAGGED_05B + "\n", "can end"),
    ("hermes", "auto", False, "```\n" + UNTAGGED_05B + "\n```", "can end"),
    ("hermes", "auto", True, "```python\nprint(1)\n```", "can end"),  # text may open with other fences,
    ("hermes", "auto", True, '{"foo": 1}', "can end"),  # other JSON,
    ("hermes", "auto", True, 'Sure: ' + UNTAGGED_05B, "can end"),  # and hold a call's JSON later on
    ("hermes", "auto", True, '```json\n{"names": 1}\n```', "can end"),
    ("hermes", "auto", True, '{"name" is the key', "refused"),  # but not open like an untagged call
    ("hermes", "auto", True, UNTAGGED_05B.replace("get_weather", "send_mail"), """refused '{"name": "send'"""),
    ("hermes", "auto", True, UNTAGGED_05B.replace('"Paris"', "7"), "refused"),  # city is a string
    ("hermes", "auto", True, UNTAGGED_15B.replace('"city"', '"town"'), "refused"),  # city is required
    ("hermes", "auto", True, UNTAGGED_05B.replace('"Paris"}', '"Paris", "days": 0}'), "refused"),  # minimum 1
    ("hermes", "auto", True, UNTAGGED_05B + " Done.", "refused"),  # nothing after the call
    ("hermes", "auto", True, UNTAGGED_15B.removesuffix("\n```"), "open"),  # the fence must close
    ("hermes", "auto", True, UNTAGGED_05B + "\n" + HERMES_TIME, "refused"),  # one untagged call, no more
    ("hermes", "required", True, UNTAGGED_05B, "refused"),  # only "auto" takes them
    ("llama3", "required", True, LLAMA3_WEATHER + "; " + LLAMA3_TIME, "can end"),
    ("llama3", "auto", True, "Paris is sunny.", "can end"),
    ("llama3", "auto", True, LLAMA3_TIME, "can end"),
    ("llama3", "auto", True, '{"name": "get_time", "parameters": {"tz": 1}}', "refused"),
    ("llama3", "get_time", True, LLAMA3_WEATHER, "refused"),
]


@pytest.mark.parametrize(("syntax", "choice", "parallel", "text", "expected"), CASES)
def test_the_grammar_takes_valid_calls_and_refuses_invalid_ones(qwen, syntax, choice, parallel, text, expected):
    grammar = call_grammar(syntax, TOOLS, choice, parallel, markup_tokens=markup_tokens(qwen[0]))
    assert matched(qwen, grammar, text).startswith(expected)


@pytest.mark.parametrize(("syntax", "reply"), [("hermes", "Sure.\n" + HERMES_WEATHER + "\n" + HERMES_TIME),
                                                ("xml", XML_WEATHER + "\n" + XML_TIME),
                                                ("llama3", LLAMA3_WEATHER + "; " + LLAMA3_TIME)])
def test_what_the_grammar_takes_the_parser_reads_as_valid_calls(qwen, syntax, reply):
    grammar = call_grammar(syntax, TOOLS, "auto", True, markup_tokens=markup_tokens(qwen[0]))
    assert matched(qwen, grammar, reply) == "can end"
    parser = OutputParser(syntax, TOOLS, constrained=True, new_call_id=lambda: "call")
    for char in reply:
        parser.feed(char)
    parser.finish()
    schemas = {tool.name: tool.parameters for tool in TOOLS}
    assert [call.name for call in parser.tool_calls] == ["get_weather", "get_time"]
    for call in parser.tool_calls:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


@pytest.mark.parametrize(("reply", "pieces"), [
    (UNTAGGED_05B, ['{"', "name", '":', ' "', "get", "_weather", '",', ' "', "arguments", '":', ' {"', "city", '":',
                    ' "', "Paris", '"}}']),
    (UNTAGGED_15B, ["```", "json", "\n", "{\n", " ", ' "', "name", '":', ' "', "get", "_weather", '",\n', " ", ' "',
                    "arguments", '":', " {\n", "   ", ' "', "city", '":', ' "', "Paris", '"\n', " ", " }\n", "}\n",
                    "```"])])
@pytest.mark.parametrize("reasoning", ["none", "optional"])
def test_qwen_coders_untagged_calls_are_taken_token_by_token_and_read_as_calls(qwen, reply, pieces, reasoning):
    tokenizer, _ = qwen
    token_ids = tokenizer.encode(reply, add_special_tokens=False)  # what the model wrote, token by token
    assert [tokenizer.decode([token]) for token in token_ids] == pieces  # the fence and "{" merge in tokens
    for parallel in (True, False):
        grammar = call_grammar("hermes", TOOLS, "auto", parallel, reasoning=reasoning,
                               markup_tokens=markup_tokens(tokenizer))
        assert matched(qwen, grammar, token_ids=token_ids) == "can end"
        assert matched(qwen, grammar, token_ids=[*token_ids, *tokenizer.encode("\n", add_special_tokens=False)]) == "can end"
    spelled = call_grammar("hermes", TOOLS, "auto", True, markup_tokens=())  # a vocabulary without the tags
    assert matched(qwen, spelled, token_ids=token_ids) == "can end"
    assert matched(qwen, spelled, "```python\nprint(1)\n```") == "can end"
    parser = OutputParser("hermes", TOOLS, constrained=True, new_call_id=lambda: "call")
    events = [event for token in token_ids for event in parser.feed(tokenizer.decode([token]))] + parser.finish()
    assert parser.text == "" and not [e for e in events if isinstance(e, TextDelta)]
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_the_grammar_takes_the_templates_own_rendering_of_a_call(qwen):
    tokenizer, _ = qwen
    calls = [{"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]
    tools = [tool.template_dict() for tool in TOOLS]
    history = [{"role": "user", "content": "Weather?"}]
    prompt = tokenizer.render_chat(history, add_generation_prompt=True, tools=tools)
    rendered = tokenizer.render_chat([*history, {"role": "assistant", "content": "", "tool_calls": calls}],
                                     add_generation_prompt=False, tools=tools)
    reply = rendered[len(prompt):].removesuffix("<|im_end|>\n")
    assert matched(qwen, call_grammar("hermes", TOOLS, "required", False), reply) == "stopped"


def test_spelled_out_markup_is_text_to_the_grammar(qwen):
    tokenizer, _ = qwen
    spelled = [*tokenizer.encode("Hi <", add_special_tokens=False), *tokenizer.encode("tool_call>", add_special_tokens=False)]
    assert tokenizer.decode(spelled) == "Hi <tool_call>" and 151657 not in spelled
    # With the tags as tokens, text may not spell one out: the parser would take it for a call.
    assert matched(qwen, call_grammar("hermes", TOOLS, "auto", True), token_ids=spelled).startswith("refused")
    # A vocabulary without the tags gets them as text, and the call grammar binds after the spelled tag.
    as_text = call_grammar("hermes", TOOLS, "auto", True, markup_tokens=())
    body = HERMES_TIME.removeprefix("<tool_call>").removesuffix("</tool_call>")
    ids = spelled + tokenizer.encode(body, add_special_tokens=False) + tokenizer.encode("</", add_special_tokens=False)
    ids += tokenizer.encode("tool_call>", add_special_tokens=False)
    assert matched(qwen, as_text, token_ids=ids) == "can end"
    assert matched(qwen, as_text, "Hi " + HERMES_TIME).startswith("refused")  # the token is not that text


def test_reasoning_comes_first_when_the_model_thinks(qwen):
    tokens = markup_tokens(qwen[0])  # Qwen2.5 has no <think> token: the tags are text here
    opened = call_grammar("hermes", TOOLS, "required", True, reasoning="open", markup_tokens=tokens)
    assert matched(qwen, opened, "First the city.\n</think>\n\n" + HERMES_TIME) == "can end"
    assert matched(qwen, opened, HERMES_TIME).startswith("refused")  # the token cannot be reasoning text
    optional = call_grammar("hermes", TOOLS, "auto", True, reasoning="optional", markup_tokens=tokens)
    assert matched(qwen, optional, "<think>\nHm.\n</think>\n\nIt is " + HERMES_TIME) == "can end"
    assert matched(qwen, optional, "No thinking today.") == "can end"
    with pytest.raises(ValueError, match="unknown special token"):  # a <think> token it does not have
        matched(qwen, call_grammar("hermes", TOOLS, "required", True, reasoning="open"), "x")


def test_what_gets_no_grammar_and_what_is_refused():
    assert call_grammar("hermes", TOOLS, "none", True) is None
    assert call_grammar("hermes", [], "auto", True) is None
    assert call_grammar(None, TOOLS, "required", True) is None
    with pytest.raises(ValueError, match="'send_mail', which is not one of the tools"):
        call_grammar("hermes", TOOLS, "send_mail", True)
    with pytest.raises(ValueError, match="unknown tool-call syntax"):
        call_grammar("mistral", TOOLS, "auto", True)
    with pytest.raises(ValueError, match="unknown reasoning start"):
        call_grammar("hermes", TOOLS, "auto", True, reasoning="maybe")


@pytest.mark.parametrize(("tool", "message"), [
    (Tool("a", "", {"type": "string"}), "tool 'a': parameters must be the JSON schema of an object"),
    (Tool("b", "", {"type": "object", "properties": {"x": {"type": "nonsense"}}}), "tool 'b': its parameters schema"),
    (Tool("c", "", {"type": "object", "properties": {"x": {"$ref": "#/$defs/gone"}}}), "tool 'c': its parameters"),
    (Tool("d e", "", {"type": "object"}), "tool 'd e': a name"),
])
def test_check_tools_names_the_bad_tool(tool, message):
    check_tools(TOOLS + [Tool("ok", "", {})])
    with pytest.raises(ValueError, match=message):
        check_tools([WEATHER, tool])
    with pytest.raises(ValueError, match="two tools are named 'get_time'"):
        check_tools([TIME, TIME])


# -- freeform (custom) tools: their input held to their own grammar -------------------------------
PATCH_LARK = ('start: begin hunk+ "*** End Patch" LF?\nbegin: "*** Begin Patch" LF\n'
              'hunk: "*** Add File: " /(.+)/ LF ("+" /(.*)/ LF -> line)+\n%import common.LF\n')
PATCH_TOOL = Tool("apply_patch", "Edit files.", {"type": "object", "properties": {"input": {"type": "string"}},
                                                 "required": ["input"]}, Freeform("lark", PATCH_LARK))
GOOD_PATCH = '*** Begin Patch\n*** Add File: a "b".py\n+print("hi\\tthere")\n+\tx = 1\n*** End Patch\n'
BAD_PATCH = "*** Begin Patch\n*** Frobnicate: a.py\n*** End Patch\n"


def freeform_call(syntax: str, text: str) -> str:
    if syntax == "xml":
        return f"<tool_call>\n<function=apply_patch>\n<parameter=input>\n{text}\n</parameter>\n</function>\n</tool_call>"
    key = "arguments" if syntax == "hermes" else "parameters"
    call = f'{{"name": "apply_patch", "{key}": {json.dumps({"input": text})}}}'
    return f"<tool_call>\n{call}\n</tool_call>" if syntax == "hermes" else call


@pytest.mark.parametrize("syntax", ["hermes", "xml", "llama3"])
def test_a_freeform_input_is_held_to_its_grammar_raw_or_json_quoted(qwen, syntax):
    """xml writes the input as it is; hermes and llama3 inside a JSON string, where the grammar is
    rewritten to take its escaped form: quotes, backslashes, tabs and newlines included."""
    grammar = call_grammar(syntax, [PATCH_TOOL, WEATHER], "apply_patch", True, markup_tokens=markup_tokens(qwen[0]))
    assert matched(qwen, grammar, freeform_call(syntax, GOOD_PATCH)) in ("stopped", "can end")
    assert matched(qwen, grammar, freeform_call(syntax, BAD_PATCH)).startswith("refused")
    parser = OutputParser(syntax, [PATCH_TOOL, WEATHER], constrained=True)
    parser.feed(freeform_call(syntax, GOOD_PATCH))
    parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parser.tool_calls] == [("apply_patch", {"input": GOOD_PATCH})]


@pytest.mark.parametrize(("freeform", "good", "bad"), [
    (Freeform("regex", r"(add|drop) [a-z]+/\d{2}"), "add cats/42", "add Cats/42"),
    (Freeform("regex", r'say "[^"\n]*"'), 'say "hi\tthere"', 'say "a"b"'),
    (Freeform("lark", 'start: "SELECT"i " " NAME\nNAME: /[a-z_]+/\n'), "select rows", "select Rows"),
    (Freeform("text"), 'any "text"\n\\ at all', None),
])
def test_freeform_grammars_in_a_json_string(qwen, freeform, good, bad):
    tool = Tool("run", "", PATCH_TOOL.parameters, freeform)
    grammar = call_grammar("hermes", [tool], "run", True)
    call = '<tool_call>\n{"name": "run", "arguments": %s}\n</tool_call>'
    assert matched(qwen, grammar, call % json.dumps({"input": good})) in ("stopped", "can end")
    if bad is not None:
        assert matched(qwen, grammar, call % json.dumps({"input": bad})).startswith("refused")


@pytest.mark.parametrize(("definition", "message"), [
    ("start: missing\n", "missing"),
    ("start: /(/\n", "grammar is refused"),
    ("start: x\n%import other.X\n", "%import other.X"),
    ("start: %json {}\n", "%json is not supported"),
])
def test_a_freeform_grammar_that_cannot_compile_is_refused_by_name(definition, message):
    with pytest.raises(ValueError, match="tool 'bad'") as info:
        check_tools([Tool("bad", "", PATCH_TOOL.parameters, Freeform("lark", definition))])
    assert message in str(info.value)
