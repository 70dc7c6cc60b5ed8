"""One call read: streamed as it arrives under the call grammar (JsonCallStream for hermes and llama3,
XmlCallStream for xml), or checked once whole without it (whole_json_call, whole_xml_call). CallLog
numbers the reply's calls across both."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from tinymlx.turns.call_markup import (
    CALL_CLOSE,
    JSON_HEAD,
    PARAMETER_CLOSE,
    XML_FUNCTION,
    XML_HEAD,
    XML_PARAMETER,
)
from tinymlx.turns.reasoning import partial_tag_length
from tinymlx.turns.tool_schema import json_text, json_value, parameter_schema, typed_value, xml_value_kind
from tinymlx.turns.turn import Tool, ToolArgumentsDelta, ToolCallEnd, ToolCallStart, TurnEvent


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class CallLog:
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


def whole_json_call(text: str, tools: dict[str, Tool]) -> tuple[str, str] | None:
    """(name, arguments) of a complete hermes / llama3 call, or None if it is not a call of a tool."""
    try:
        call = json_value(text)
        arguments = call.get("arguments", call.get("parameters")) if isinstance(call, dict) else None
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            arguments = json_value(arguments)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call.get("name"), str) or call["name"] not in tools:
        return None
    return (call["name"], json_text(arguments)) if isinstance(arguments, dict) else None


def whole_xml_call(text: str, tools: dict[str, Tool]) -> tuple[str, str] | None:
    function = XML_FUNCTION.fullmatch(text)
    tool = tools.get(function.group(1).strip()) if function else None
    if tool is None:
        return None
    body, arguments, position = function.group(2), {}, 0
    for parameter in XML_PARAMETER.finditer(body):
        if body[position : parameter.start()].strip():
            return None
        key, value = parameter.group(1).strip(), parameter.group(2)
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        arguments[key] = typed_value(value, parameter_schema(tool, key))
        position = parameter.end()
    return None if body[position:].strip() else (tool.name, json_text(arguments))


class JsonExtent:
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


class JsonCallStream:
    """A constrained hermes / llama3 call, {"name": ..., "arguments": {...}}, streamed: the grammar puts
    the name first, and the arguments pass through until their object closes. The call ends at
    `close` after them (</tool_call>, or the call object's own "}")."""

    def __init__(self, log: CallLog, tools: dict[str, Tool], close: str):
        self._log, self._tools, self._close = log, tools, close
        self.raw = ""  # everything fed, to check whole instead if it is not what the grammar writes
        self._buffer = ""
        self._arguments = JsonExtent()
        self.start: ToolCallStart | None = None
        self.is_failed = self.is_done = False
        self.rest = ""  # what followed the call's end

    def feed(self, text: str) -> list[TurnEvent]:
        self.raw += text
        self._buffer += text
        events: list[TurnEvent] = []
        if self.start is None:
            head = JSON_HEAD.match(self._buffer)
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


class XmlCallStream:
    """A constrained xml call streamed as JSON arguments: `{"key": ` when a parameter opens, then its
    value as it arrives (a string escaped; a value of one other type as written, which the grammar made
    JSON; one of no single type converted once whole), `}` at </function>. Only what may be the start
    of </parameter> is held back."""

    def __init__(self, log: CallLog, tools: dict[str, Tool]):
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
        head = XML_HEAD.match(self._buffer)
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
        at = self._buffer.find(PARAMETER_CLOSE)
        if at >= 0:
            piece = self._buffer[:at].removesuffix("\n")
            self._buffer, self._state = self._buffer[at + len(PARAMETER_CLOSE):], "parameters"
            return self._value_text(piece, is_last=True)
        held = max(partial_tag_length(self._buffer, "\n" + PARAMETER_CLOSE),
                   partial_tag_length(self._buffer, PARAMETER_CLOSE))
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
