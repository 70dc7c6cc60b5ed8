"""Tool calls out of generated text, as it streams: one parser per call syntax, and OutputParser,
which runs the reasoning splitter first and the call parser on the answer.

    hermes  <tool_call>\\n{"name": "fn", "arguments": {...}}\\n</tool_call>          Qwen2.5, Qwen3
    xml     <tool_call>\\n<function=fn>\\n<parameter=city>\\nParis\\n</parameter>\\n</function>\\n</tool_call>
                                                                              Qwen3-Coder, Qwen3.5
    llama3  {"name": "fn", "parameters": {...}}; {...}    the whole reply (after <|python_tag|>)

Under the call grammar (`constrained`) a call is well formed, so its arguments stream as they arrive:
its start (id, name) once the name is read, then the argument text, then its end at the closing tag.
Without it each call is kept until it closes and then checked: bad JSON, an unknown tool, an
unclosed call come back as the text they were, never as an error.

Whitespace around calls (before the first, between them, after the last) is not text: the templates
write their own, so a reply sent back renders the same bytes. Text after the calls is kept as text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from tinymlx.server.reasoning import ReasoningSplitter, partial_tag_length
from tinymlx.server.turns import (
    ReasoningDelta,
    TextDelta,
    Tool,
    ToolArgumentsDelta,
    ToolCall,
    ToolCallEnd,
    ToolCallStart,
    TurnEvent,
)

SYNTAXES = ("hermes", "xml", "llama3")
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_PARAMETER_CLOSE = "</parameter>"
# {"name": "fn", "arguments": ...}: the call can start once its name and the arguments' key are read.
_JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_XML_HEAD = re.compile(r"\s*<function=([^>\n]+)>")
_XML_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.S)
_XML_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def syntax_for_template(chat_template_source: str | None) -> str | None:
    """The call syntax a chat template teaches its model, read from the template's text."""
    source = chat_template_source or ""
    if "<function=" in source:
        return "xml"
    if CALL_OPEN in source:
        return "hermes"
    if PYTHON_TAG in source or ('"parameters"' in source and "<|start_header_id|>" in source):
        return "llama3"
    return None


def json_text(value: Any) -> str:
    """Arguments as JSON text the way the parser writes them (json.dumps' separators, UTF-8 kept)."""
    return json.dumps(value, ensure_ascii=False)


def schema_types(schema: Any) -> set[str]:
    """The JSON types a (sub)schema allows, as far as its type / enum / const / anyOf say."""
    if not isinstance(schema, dict):
        return set()
    if isinstance(schema.get("type"), str):
        return {schema["type"]}
    if isinstance(schema.get("type"), list):
        return {t for t in schema["type"] if isinstance(t, str)}
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values:
        return {_json_type(value) for value in values}
    members = schema.get("anyOf", schema.get("oneOf"))
    return set().union(*map(schema_types, members)) if isinstance(members, list) and members else set()


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "null")


def xml_value_kind(schema: Any) -> str:
    """How an xml parameter's value is written and read: "string" (raw text, the value itself),
    "json" (one non-string type: JSON text, which the grammar enforces), or "raw" (no type or several:
    raw text, converted once whole)."""
    types = schema_types(schema)
    if types == {"string"}:
        return "string"
    return "json" if len(types) == 1 else "raw"


def parameter_schema(tool: Tool, key: str) -> Any:
    """The schema of one of a tool's parameters, a local "#/$defs/..." reference followed."""
    schema = (tool.parameters.get("properties") or {}).get(key)
    reference = schema.get("$ref") if isinstance(schema, dict) else None
    if not (isinstance(reference, str) and reference.startswith("#/")):
        return schema
    target: Any = tool.parameters
    for part in reference[2:].split("/"):
        target = target.get(part) if isinstance(target, dict) else None
    return target if isinstance(target, dict) else schema


def typed_value(raw: str, schema: Any) -> Any:
    """An xml parameter's raw text as the value its schema types: strings stay text; other types are
    read as JSON (and Python's True/False, which Qwen3-Coder's template writes), else kept as text."""
    types = schema_types(schema)
    if not types or types == {"string"}:
        return raw
    try:
        value = json.loads(raw, parse_constant=_refuse)
    except ValueError:
        value = raw.strip() == "True" if raw.strip() in ("True", "False") else raw
    kind = _json_type(value)
    if kind in types or (kind == "integer" and "number" in types):
        return value
    if kind == "number" and "integer" in types and value.is_integer():
        return int(value)
    return raw


def _refuse(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")  # Python's json reads NaN and Infinity; JSON has neither


class _CallLog:
    """Numbers the reply's calls and gives each its id."""

    def __init__(self, new_call_id: Callable[[], str], parallel_tool_calls: bool):
        self._new_call_id = new_call_id
        self._is_parallel = parallel_tool_calls
        self.num_calls = 0

    @property
    def can_start(self) -> bool:
        return self._is_parallel or self.num_calls == 0

    def start(self, name: str) -> ToolCallStart:
        self.num_calls += 1
        return ToolCallStart(self.num_calls - 1, self._new_call_id(), name)

    def whole(self, name: str, arguments: str) -> list[TurnEvent]:
        start = self.start(name)
        return [start, ToolArgumentsDelta(start.index, arguments), ToolCallEnd(start.index)]


def _whole_json_call(text: str, tools: dict[str, Tool]) -> tuple[str, str] | None:
    """(name, arguments) of a complete hermes / llama3 call, or None if it is not a call of a tool."""
    try:
        call = json.loads(text, parse_constant=_refuse)
        arguments = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            arguments = json.loads(arguments, parse_constant=_refuse)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call.get("name"), str) or call["name"] not in tools:
        return None
    return (call["name"], json_text(arguments)) if isinstance(arguments, dict) else None


def _whole_xml_call(text: str, tools: dict[str, Tool]) -> tuple[str, str] | None:
    function = _XML_FUNCTION.fullmatch(text)
    tool = tools.get(function.group(1).strip()) if function else None
    if tool is None:
        return None
    body, arguments, position = function.group(2), {}, 0
    for parameter in _XML_PARAMETER.finditer(body):
        if body[position : parameter.start()].strip():
            return None
        key, value = parameter.group(1).strip(), parameter.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[key] = typed_value(value, parameter_schema(tool, key))
        position = parameter.end()
    return None if body[position:].strip() else (tool.name, json_text(arguments))


class _JsonExtent:
    """Where a JSON object that starts at the first character fed ends (strings and depth tracked)."""

    def __init__(self):
        self._depth, self._in_string, self._is_escaped = 0, False, False
        self.is_done = False

    def feed(self, text: str) -> int:
        """How much of `text` belongs to the object: all of it while it is open."""
        for i, char in enumerate(text):
            if self._in_string:
                if self._is_escaped:
                    self._is_escaped = False
                elif char == "\\":
                    self._is_escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self.is_done = True
                    return i + 1
        return len(text)


class _JsonCallStream:
    """A constrained hermes / llama3 call, {"name": ..., "arguments": {...}}, streamed: the grammar puts
    the name first, and the arguments pass through until their object closes. The call ends at
    `close` after them (</tool_call>, or the call object's own "}")."""

    def __init__(self, log: _CallLog, tools: dict[str, Tool], close: str):
        self._log, self._tools, self._close = log, tools, close
        self.raw = ""  # everything fed, to check whole instead if it is not what the grammar writes
        self._buffer = ""
        self._arguments = _JsonExtent()
        self.start: ToolCallStart | None = None
        self.is_failed = self.is_done = False
        self.rest = ""  # what followed the call's end

    def feed(self, text: str) -> list[TurnEvent]:
        self.raw += text
        self._buffer += text
        events: list[TurnEvent] = []
        if self.start is None:
            head = _JSON_HEAD.match(self._buffer)
            value = self._buffer[head.end():].lstrip() if head else ""
            if not value:
                self.is_failed = self._close == CALL_CLOSE and CALL_CLOSE in self._buffer
                return []
            try:
                name = json.loads(head.group(1))
            except ValueError:  # a raw control character or a bad escape in the name
                name = None
            if value[0] != "{" or name not in self._tools:
                self.is_failed = True
                return []
            self.start, self._buffer = self._log.start(name), value
            events.append(self.start)
        if not self._arguments.is_done:
            end = self._arguments.feed(self._buffer)
            if end:
                events.append(ToolArgumentsDelta(self.start.index, self._buffer[:end]))
            self._buffer = self._buffer[end:]
        if self._arguments.is_done:
            at = self._buffer.find(self._close)
            if at >= 0:
                self.rest, self.is_done = self._buffer[at + len(self._close):], True
                events.append(ToolCallEnd(self.start.index))
        return events

    def finish(self) -> list[TurnEvent]:
        """A call cut short (max_tokens) ends with the arguments it has."""
        return [ToolCallEnd(self.start.index)] if self.start is not None and not self.is_done else []


class _XmlCallStream:
    """A constrained xml call streamed as JSON arguments: `{"key": ` when a parameter opens, then its
    value as it arrives (a string escaped; a value of one other type as written, which the grammar made
    JSON; one of no single type converted once whole), `}` at </function>. Only what may be the start
    of </parameter> is held back."""

    def __init__(self, log: _CallLog, tools: dict[str, Tool]):
        self._log, self._tools = log, tools
        self.raw, self._buffer = "", ""
        self.start: ToolCallStart | None = None
        self._state = "head"  # head -> (parameters <-> value)* -> tail
        self._tool: Tool | None = None
        self._num_parameters, self._kind, self._schema, self._value, self._is_fresh = 0, "", None, "", False
        self.is_failed = self.is_done = False
        self.rest = ""

    def feed(self, text: str) -> list[TurnEvent]:
        self.raw += text
        self._buffer += text
        events: list[TurnEvent] = []
        arguments = ""
        while not (self.is_failed or self.is_done):
            before = (self._state, len(self._buffer))
            if self._state == "head":
                if self._head():
                    events.append(self.start)
            elif self._state == "parameters":
                arguments += self._parameters()
            elif self._state == "value":
                arguments += self._value_piece()
            else:
                self._tail()
            if (self._state, len(self._buffer)) == before:
                break
        if arguments:
            events.append(ToolArgumentsDelta(self.start.index, arguments))
        if self.is_done:
            events.append(ToolCallEnd(self.start.index))
        return events

    def _head(self) -> bool:
        head = _XML_HEAD.match(self._buffer)
        tool = self._tools.get(head.group(1).strip()) if head else None
        if tool is None:
            self.is_failed = bool(head) or CALL_CLOSE in self._buffer
            return False
        self.start, self._buffer, self._state = self._log.start(tool.name), self._buffer[head.end():], "parameters"
        self._tool = tool
        return True

    def _parameters(self) -> str:
        text = self._buffer.lstrip()
        if text.startswith("<parameter="):
            close = text.find(">")
            if close < 0:
                self._buffer = text
                return ""
            key = text[len("<parameter="):close].strip()
            self._schema = parameter_schema(self._tool, key)
            self._kind = xml_value_kind(self._schema) if self._schema is not None else "string"
            self._buffer, self._state, self._value, self._is_fresh = text[close + 1:], "value", "", True
            self._num_parameters += 1
            separator = "{" if self._num_parameters == 1 else ", "
            return separator + json_text(key) + ": " + ('"' if self._kind == "string" else "")
        if "<parameter=".startswith(text) or "</function>".startswith(text):
            self._buffer = text
            return ""
        # </function> (or, never under the grammar, anything else) ends the arguments.
        self._buffer = text[len("</function>"):] if text.startswith("</function>") else text
        self._state = "tail"
        return "}" if self._num_parameters else "{}"

    def _value_piece(self) -> str:
        if self._is_fresh:  # the value starts after the tag's own newline
            if not self._buffer:
                return ""
            self._buffer, self._is_fresh = self._buffer.removeprefix("\n"), False
        at = self._buffer.find(_PARAMETER_CLOSE)
        if at >= 0:
            piece = self._buffer[:at].removesuffix("\n")
            self._buffer, self._state = self._buffer[at + len(_PARAMETER_CLOSE):], "parameters"
            return self._value_text(piece, is_last=True)
        held = max(partial_tag_length(self._buffer, "\n" + _PARAMETER_CLOSE),
                   partial_tag_length(self._buffer, _PARAMETER_CLOSE))
        piece, self._buffer = self._buffer[: len(self._buffer) - held], self._buffer[len(self._buffer) - held:]
        return self._value_text(piece, is_last=False)

    def _value_text(self, piece: str, is_last: bool) -> str:
        if self._kind == "string":
            return json_text(piece)[1:-1] + ('"' if is_last else "")
        if self._kind == "json":
            return piece
        self._value += piece
        return json_text(typed_value(self._value, self._schema)) if is_last else ""

    def _tail(self) -> None:
        at = self._buffer.find(CALL_CLOSE)
        if at >= 0:
            self.rest, self.is_done = self._buffer[at + len(CALL_CLOSE):], True

    def finish(self) -> list[TurnEvent]:
        return [ToolCallEnd(self.start.index)] if self.start is not None and not self.is_done else []


class _TaggedCalls:
    """hermes and xml: calls between <tool_call> and </tool_call>, in the text or after it."""

    def __init__(self, syntax: str, tools: dict[str, Tool], log: _CallLog, constrained: bool):
        self._syntax, self._tools, self._log, self._is_constrained = syntax, tools, log, constrained
        self._buffer = ""
        self._gap = ""  # the whitespace before the open call: text again if the call is not one
        self._stream: _JsonCallStream | _XmlCallStream | None = None  # a constrained call, streaming
        self._pending: str | None = None  # an unconstrained call, kept until it closes
        self._is_discarding = False  # a call past the one parallel_tool_calls=False allows
        self._is_after_call = False  # whitespace here is the template's, not text

    def feed(self, text: str) -> list[TurnEvent]:
        self._buffer += text
        events: list[TurnEvent] = []
        while self._buffer:
            in_text = self._stream is None and self._pending is None
            if not (self._text(events) if in_text else self._call(events)):
                break
        return events

    def finish(self) -> list[TurnEvent]:
        events: list[TurnEvent] = []
        if self._stream is not None:
            if self._stream.start is not None:
                events += self._stream.finish()
                self._buffer = ""
            else:
                self._pending, self._buffer = self._stream.raw + self._buffer, ""
            self._stream = None
        if self._pending is not None:
            if not self._is_discarding:
                self._emit(events, self._gap + CALL_OPEN + self._pending + self._buffer)
        else:
            self._emit(events, self._buffer)
        self._buffer, self._pending = "", None
        return events

    def _emit(self, events: list[TurnEvent], text: str) -> None:
        if self._is_after_call:
            text = text.lstrip()
            self._is_after_call = not text
        if text:
            events.append(TextDelta(text))

    def _text(self, events: list[TurnEvent]) -> bool:
        at = self._buffer.find(CALL_OPEN)
        if at >= 0:
            text = self._buffer[:at]
            self._emit(events, text.rstrip())
            self._gap, self._buffer = text[len(text.rstrip()):], self._buffer[at + len(CALL_OPEN):]
            self._is_discarding = not self._log.can_start
            if self._is_constrained and not self._is_discarding:
                self._stream = (_JsonCallStream(self._log, self._tools, CALL_CLOSE) if self._syntax == "hermes"
                                else _XmlCallStream(self._log, self._tools))
            else:
                self._pending = ""
            return True
        # Hold back what may open a call, and trailing whitespace (dropped if a call follows).
        held = partial_tag_length(self._buffer, CALL_OPEN)
        kept = len(self._buffer[: len(self._buffer) - held].rstrip())
        if not kept:
            return False
        self._emit(events, self._buffer[:kept])
        self._buffer = self._buffer[kept:]
        return True

    def _call(self, events: list[TurnEvent]) -> bool:
        if self._stream is not None:
            text, self._buffer = self._buffer, ""
            events += self._stream.feed(text)
            if self._stream.is_failed:  # check it whole once it closes
                self._pending, self._buffer, self._stream = "", self._stream.raw, None
            elif self._stream.is_done:
                self._buffer, self._stream, self._is_after_call = self._stream.rest, None, True
            return True
        self._pending += self._buffer
        self._buffer = ""
        at = self._pending.find(CALL_CLOSE)
        if at < 0:
            return False
        inner, self._buffer, self._pending = self._pending[:at], self._pending[at + len(CALL_CLOSE):], None
        if self._is_discarding:
            self._is_after_call = True
            return True
        call = _whole_json_call(inner, self._tools) if self._syntax == "hermes" else _whole_xml_call(inner, self._tools)
        if call is None:
            self._emit(events, self._gap + CALL_OPEN + inner + CALL_CLOSE)
        else:
            events += self._log.whole(*call)
            self._is_after_call = True
        return True


class _Llama3Calls:
    """llama3: the whole reply is calls, `{...}; {...}` (after <|python_tag|>), when it opens with "{";
    otherwise it is text."""

    def __init__(self, syntax: str, tools: dict[str, Tool], log: _CallLog, constrained: bool):
        self._tools, self._log, self._is_constrained = tools, log, constrained
        self._state = "start"  # start -> (call -> between)* -> text
        self._buffer = ""
        self._prefix = ""  # what came before this call since the last one: text again if it is not one
        self._stream: _JsonCallStream | None = None
        self._object, self._extent, self._is_discarding = "", _JsonExtent(), False

    def feed(self, text: str) -> list[TurnEvent]:
        self._buffer += text
        events: list[TurnEvent] = []
        while self._buffer:
            before = (self._state, len(self._buffer))
            if self._state == "text":
                events.append(TextDelta(self._buffer))
                self._buffer = ""
            elif self._state == "call":
                self._call(events)
            else:
                self._between()
            if (self._state, len(self._buffer)) == before:
                break
        return events

    def finish(self) -> list[TurnEvent]:
        events: list[TurnEvent] = []
        if self._state == "call" and self._stream is not None and self._stream.start is not None:
            events += self._stream.finish()
        elif self._state == "call" and not self._is_discarding:
            raw = self._stream.raw if self._stream is not None else self._object
            events.append(TextDelta(self._prefix + raw + self._buffer))
        elif self._state in ("start", "text") and self._buffer:
            events.append(TextDelta(self._buffer))
        self._buffer = ""
        return events

    def _between(self) -> None:
        """At the start (whitespace, <|python_tag|>) or after a call (whitespace, ";"): a call next?"""
        text = self._buffer.lstrip()
        if self._state == "start" and text.startswith(PYTHON_TAG):
            text = text[len(PYTHON_TAG):].lstrip()
        elif self._state == "between" and text.startswith(";"):
            text = text[1:].lstrip()
        if not text or (self._state == "start" and PYTHON_TAG.startswith(text)):
            return  # wait
        if text[0] != "{":
            if self._state == "start":
                self._state = "text"  # the buffer, untouched, is the text
            else:
                self._state, self._buffer = "text", self._buffer.lstrip()
            return
        self._prefix = self._buffer[: len(self._buffer) - len(text)] if self._state == "start" else ""
        self._state, self._buffer = "call", text
        self._is_discarding = not self._log.can_start
        if self._is_constrained and not self._is_discarding:
            self._stream = _JsonCallStream(self._log, self._tools, "}")
        else:
            self._stream, self._object, self._extent = None, "", _JsonExtent()

    def _call(self, events: list[TurnEvent]) -> None:
        if self._stream is not None:
            text, self._buffer = self._buffer, ""
            events += self._stream.feed(text)
            if self._stream.is_failed:
                self._stream, self._object, self._extent, self._buffer = None, "", _JsonExtent(), self._stream.raw
            elif self._stream.is_done:
                self._state, self._buffer, self._stream = "between", self._stream.rest, None
            return
        end = self._extent.feed(self._buffer)
        self._object, self._buffer = self._object + self._buffer[:end], self._buffer[end:]
        if not self._extent.is_done:
            return
        call = _whole_json_call(self._object, self._tools)
        if self._is_discarding:
            self._state = "between"
        elif call is None:
            self._state, self._buffer = "text", self._prefix + self._object + self._buffer
        else:
            events += self._log.whole(*call)
            self._state = "between"


class OutputParser:
    """A reply's text as it streams -> TurnEvents: reasoning, text, and tool calls (start, argument
    pieces, end); `text`, `reasoning` and `tool_calls` hold the totals so far."""

    def __init__(self, syntax: str | None, tools: Sequence[Tool], starts_in_reasoning: bool = False,
                 constrained: bool = False, parallel_tool_calls: bool = True,
                 new_call_id: Callable[[], str] = lambda: f"call_{uuid.uuid4().hex[:24]}",
                 splits_reasoning: bool = True):
        if syntax is not None and syntax not in SYNTAXES:
            raise ValueError(f"unknown tool-call syntax {syntax!r}; choose one of {', '.join(SYNTAXES)}")
        # Qwen3.5 may open its call inside reasoning without closing it; the call grammar never does.
        implicit_end = CALL_OPEN + "\n<function=" if syntax == "xml" and not constrained else None
        self._splitter = (ReasoningSplitter(starts_in_reasoning, implicit_end)
                          if splits_reasoning or starts_in_reasoning else None)
        log = _CallLog(new_call_id, parallel_tool_calls)
        by_name = {tool.name: tool for tool in tools}
        scanner = _Llama3Calls if syntax == "llama3" else _TaggedCalls
        self._calls = scanner(syntax, by_name, log, constrained) if syntax is not None else None
        self._text: list[str] = []
        self._reasoning: list[str] = []
        self._tool_calls: list[tuple[str, str, list[str]]] = []  # (id, name, argument pieces)

    def feed(self, delta_text: str) -> list[TurnEvent]:
        if not delta_text:
            return []
        return self._route(self._splitter.feed(delta_text) if self._splitter else [TextDelta(delta_text)], None)

    def finish(self) -> list[TurnEvent]:
        """The end of the reply: what was held back, and the end of a call cut short."""
        pieces = self._splitter.finish() if self._splitter else []
        return self._route(pieces, self._calls.finish if self._calls is not None else None)

    @property
    def text(self) -> str:
        return "".join(self._text)

    @property
    def reasoning(self) -> str | None:
        return "".join(self._reasoning) or None

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(call_id, name, "".join(pieces)) for call_id, name, pieces in self._tool_calls]

    def _route(self, pieces: list[TextDelta | ReasoningDelta], finish: Callable[[], list[TurnEvent]] | None
               ) -> list[TurnEvent]:
        events: list[TurnEvent] = []
        for piece in pieces:
            if isinstance(piece, TextDelta) and self._calls is not None:
                events += self._calls.feed(piece.text)
            else:
                events.append(piece)
        if finish is not None:
            events += finish()
        for event in events:
            if isinstance(event, TextDelta):
                self._text.append(event.text)
            elif isinstance(event, ReasoningDelta):
                self._reasoning.append(event.text)
            elif isinstance(event, ToolCallStart):
                self._tool_calls.append((event.id, event.name, []))
            elif isinstance(event, ToolArgumentsDelta):
                self._tool_calls[event.index][2].append(event.text)
        return [e for e in events if not isinstance(e, (TextDelta, ReasoningDelta)) or e.text]
