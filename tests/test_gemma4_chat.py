"""Gemma 4's chat syntax: thinking in `<|channel>thought ... <channel|>`, calls as
`<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`, read by the shared parser and sampled under
its grammar, through the server.

The template here is written in the shape of Gemma 4's (turns, thinking switched on by <|think|>, tool
declarations, calls and responses in Gemma's notation), behind a byte-level tokenizer with Gemma 4's
control tokens and a tiny model whose replies the tests script (harmony_model.scripted)."""

from __future__ import annotations

import json

import openai
import pytest
from harmony_model import accepts, as_grammar, scripted
from server_harness import RunningServer
from tiny_models import byte_tokenizer_backend, tiny_model

from tinymlx import EngineConfig
from tinymlx.engine.engine import Engine
from tinymlx.text.tokenizer import Tokenizer
from tinymlx.turns.gemma_calls import gemma_grammar, whole_gemma_call
from tinymlx.turns.reply_format import ReplyFormat
from tinymlx.turns.tool_calls import OutputParser
from tinymlx.turns.turn import ReasoningDelta, TextDelta, Tool, ToolCall

CONTROL = ("<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|tool>",
           "<tool|>", "<|tool_response>", "<tool_response|>", "<|think|>")
TEMPLATE = """{% if messages[0].role == "system" or tools or enable_thinking %}<|turn>system
{% if enable_thinking %}<|think|>{% endif %}{% if messages[0].role == "system" %}{{ messages[0].content }}{% endif %}
{% for tool in tools %}<|tool>declaration:{{ tool.function.name }}{description:<|"|>{{ tool.function.description }}\
<|"|>}<tool|>{% endfor %}<turn|>
{% endif %}
{% for message in messages %}
{% if message.role == "user" %}<|turn>user
{{ message.content }}<turn|>
{% elif message.role == "assistant" %}<|turn>model
{% for call in message.tool_calls %}<|tool_call>call:{{ call.function.name }}{{ "{" }}\
{% for key, value in call.function.arguments | dictsort %}{{ key }}:{% if value is string %}<|"|>{{ value }}<|"|>\
{% else %}{{ value | tojson }}{% endif %}{% if not loop.last %},{% endif %}{% endfor %}{{ "}" }}<tool_call|>{% endfor %}\
{{ message.content }}<turn|>
{% elif message.role == "tool" %}<|tool_response>response:{{ message.name }}{value:<|"|>{{ message.content }}<|"|>}\
<tool_response|>
{% endif %}
{% endfor %}
{% if add_generation_prompt %}<|turn>model
{% endif %}"""

WEATHER = Tool("get_weather", "The weather in a city.", {
    "type": "object", "required": ["city"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "units": {"enum": ["c", "f"], "type": "string"},
                   "tags": {"type": "array", "items": {"type": "string"}}, "opts": {"type": "object"}}})
TIME = Tool("get_time", "The time.", {"type": "object", "properties": {}})
TOOLS = (WEATHER, TIME)
THOUGHT = "<|channel>thought\nWhich tool? {braces} and, commas.<channel|>"
CALLS = ('<|tool_call>call:get_weather{city:<|"|>Pa"ris}, {x:1}<|"|>,days:3,opts:{deep:[1,-2.5e1,null,true]},'
         'tags:[<|"|>a<|"|>]}<tool_call|><|tool_call>call:get_time{}<tool_call|>')
CALLS_AS_JSON = [("get_weather", {"city": 'Pa"ris}, {x:1}', "days": 3, "opts": {"deep": [1, -25.0, None, True]},
                  "tags": ["a"]}), ("get_time", {})]


def parse(text: str, cuts=None, constrained: bool = True) -> OutputParser:
    parser = ReplyFormat.of_template(TEMPLATE).parser(TOOLS, constrained=constrained,
                                                      new_call_id=iter(f"call_{i}" for i in range(9)).__next__)
    bounds = [0, *(cuts if cuts is not None else range(1, len(text))), len(text)]
    parser.events = [e for a, b in zip(bounds, bounds[1:]) for e in parser.feed(text[a:b])] + parser.finish()
    return parser


def calls_of(parser: OutputParser) -> list[tuple[str, dict]]:
    return [(call.name, json.loads(call.arguments)) for call in parser.tool_calls]


def test_the_template_is_read_as_gemma4():
    reply_format = ReplyFormat.of_template(TEMPLATE)
    assert (reply_format.call_syntax, reply_format.thinks, reply_format.keeps_markup) == ("gemma4", True, True)


@pytest.mark.parametrize("constrained", [False, True])
def test_thought_text_and_calls_whatever_the_chunks(constrained):
    reply = THOUGHT + "Checking." + CALLS
    whole = parse(reply, cuts=[], constrained=constrained)
    assert whole.reasoning == "Which tool? {braces} and, commas." and whole.text == "Checking."
    assert calls_of(whole) == CALLS_AS_JSON
    for cuts in (None, [3, 20, len(THOUGHT) - 2, len(THOUGHT) + 12, len(reply) - 5]):
        split = parse(reply, cuts, constrained=constrained)
        assert (split.reasoning, split.text, split.tool_calls) == (whole.reasoning, whole.text, whole.tool_calls)
    kinds = [type(e) for e in parse(reply).events]
    assert kinds.index(TextDelta) > max(i for i, k in enumerate(kinds) if k is ReasoningDelta)  # thinking streams first


@pytest.mark.parametrize("call", [
    '<|tool_call>call:get_weather{city:<|"|>Paris}<tool_call|>',  # an unclosed string
    "<|tool_call>call:get_weather{city:Paris}<tool_call|>",  # a bare string
    '<|tool_call>call:launch{city:<|"|>Paris<|"|>}<tool_call|>',  # no such tool
    '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>} trailing<tool_call|>',
])
def test_a_malformed_call_under_auto_comes_back_as_text(call):
    parser = parse("Sure." + call, constrained=False)
    assert parser.tool_calls == [] and parser.text == "Sure." + call


def test_the_notation_reads_as_json():
    tools = {"get_weather": WEATHER}
    assert whole_gemma_call('call:get_weather{ city : <|"|>a<|"|> , days:-0}', tools) == (
        "get_weather", '{"city": "a", "days": 0}')
    assert whole_gemma_call("call:get_weather{days:01}", tools) is None  # JSON's numbers only
    assert whole_gemma_call("call:get_weather{days:3,}", tools) is None


# -- the grammar and the server -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma4_chat")
    backend = byte_tokenizer_backend()
    backend.add_special_tokens(list(CONTROL))
    backend.save(str(path / "tokenizer.json"))
    ends = [backend.token_to_id(token) for token in ("<turn|>", "<eos>")]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ends}))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": TEMPLATE}))
    return path


def test_the_call_grammar_holds_the_schema_and_the_choice(model_dir):
    tokenizer = Tokenizer.from_dir(model_dir)
    required = gemma_grammar(TOOLS, "required", True)
    assert accepts(tokenizer, required, THOUGHT + CALLS)
    assert not accepts(tokenizer, required, THOUGHT + "Just text.")
    for wrong in ('{days:3}', '{days:3,city:<|"|>x<|"|>}', '{city:<|"|>x<|"|>,days:3.5}',
                  '{city:<|"|>x<|"|>,units:<|"|>k<|"|>}', '{city:<|"|>x<|"|>,city:<|"|>y<|"|>}'):
        # a required key missing, keys out of order, the wrong type, outside the enum, a key twice
        assert not accepts(tokenizer, required, f"<|tool_call>call:get_weather{wrong}<tool_call|>"), wrong
    single = gemma_grammar(TOOLS, "required", False)
    assert not accepts(tokenizer, single, CALLS)  # parallel_tool_calls=False: one call
    named = gemma_grammar(TOOLS, "get_time", True)
    assert accepts(tokenizer, named, "<|tool_call>call:get_time{}<tool_call|>")
    assert not accepts(tokenizer, named, CALLS)
    auto = gemma_grammar(TOOLS, "auto", True)
    for reply in ("Hello.", THOUGHT + "Hello.", "Checking." + CALLS, THOUGHT + CALLS):
        assert accepts(tokenizer, auto, reply), reply


@pytest.fixture
def server(model_dir):
    engine = Engine(tiny_model(0, std=0.05), Tokenizer.from_dir(model_dir),
                    EngineConfig(block_size=16, num_pages=256, max_num_batched_tokens=512), model_name="tiny-gemma4-chat")
    running = RunningServer(engine)
    yield running
    running.close()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_thinking_and_calls_through_chat_completions_and_responses(server, stream):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.parameters}} for t in TOOLS]
    asked = scripted(server.engine, as_grammar(THOUGHT + CALLS, CONTROL))
    body = dict(model=server.model, messages=[{"role": "user", "content": "Weather?"}], max_tokens=300,
                tools=tools, tool_choice="required", extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    if stream:
        reasoning, calls = "", {}
        for chunk in client.chat.completions.create(**body, stream=True):
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for call in delta.tool_calls or []:
                name, arguments = calls.get(call.index, ("", ""))
                calls[call.index] = (name + (call.function.name or ""), arguments + (call.function.arguments or ""))
        calls = [(name, json.loads(arguments)) for name, arguments in calls.values()]
    else:
        message = client.chat.completions.create(**body).choices[0].message
        reasoning = message.model_extra["reasoning_content"]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    assert (reasoning, calls) == ("Which tool? {braces} and, commas.", CALLS_AS_JSON)
    assert asked[-1].skip_special_tokens is False
    assert accepts(server.engine.tokenizer, asked[-1].grammar, THOUGHT + CALLS)  # the server's own grammar allows it
    assert "<|think|>" in server.engine.tokenizer.render_chat([{"role": "user", "content": "x"}], enable_thinking=True)

    scripted(server.engine, as_grammar(THOUGHT + "Sunny.", CONTROL))
    request = dict(model=server.model, input="Weather?", max_output_tokens=300, store=False)
    if stream:
        with client.responses.stream(**request) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**request)
    assert [(item.type, item.content[0].text) for item in response.output] == [
        ("reasoning", "Which tool? {braces} and, commas."), ("message", "Sunny.")]
    server.wait_idle()


def test_a_call_sent_back_renders_in_gemmas_notation(server):
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [ToolCall("c", "get_weather", '{"days": 3, "city": "Paris"}')
                                                                  .template_dict()]},
               {"role": "tool", "name": "get_weather", "content": "sunny"}]
    rendered = server.engine.tokenizer.render_chat(history)
    assert ('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|><turn|>\n'
            '<|tool_response>response:get_weather{value:<|"|>sunny<|"|>}<tool_response|>') in rendered
    # and what the model wrote for that call reads back as the same call
    parser = parse('<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>')
    assert calls_of(parser) == [("get_weather", {"city": "Paris", "days": 3})]
