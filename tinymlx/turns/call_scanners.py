"""Where a reply's calls are: between <tool_call> tags anywhere in the text (hermes, xml), or the
whole reply (llama3, and hermes' untagged call: see call_untagged.py). Each scanner hands a call to its stream when the grammar wrote it, or keeps it
until it closes and checks it whole; what is not a call comes back as the text it was."""

from __future__ import annotations

from tinymlx.turns.call_markup import CALL_CLOSE, CALL_OPEN, PYTHON_TAG
from tinymlx.turns.call_streams import (
    CallLog,
    JsonCallStream,
    JsonExtent,
    XmlCallStream,
    whole_json_call,
    whole_xml_call,
)
from tinymlx.turns.call_untagged import UntaggedCall
from tinymlx.turns.gemma_calls import CALL_CLOSE as GEMMA_CALL_CLOSE
from tinymlx.turns.gemma_calls import CALL_OPEN as GEMMA_CALL_OPEN
from tinymlx.turns.gemma_calls import whole_gemma_call
from tinymlx.turns.reasoning import partial_tag_length
from tinymlx.turns.turn import TextDelta, Tool, TurnEvent


class TaggedCalls:
    """hermes and xml: calls between <tool_call> and </tool_call>, in the text or after it; gemma4: between
    <|tool_call> and <tool_call|>, each checked whole (its notation is not JSON to stream)."""

    def __init__(self, syntax: str, tools: dict[str, Tool], log: CallLog, constrained: bool):
        self._syntax, self._tools, self._log = syntax, tools, log
        self._is_constrained = constrained and syntax != "gemma4"
        self._open, self._close = (GEMMA_CALL_OPEN, GEMMA_CALL_CLOSE) if syntax == "gemma4" else (CALL_OPEN, CALL_CLOSE)
        self._buffer = ""
        self._gap = ""  # the whitespace before the open call: text again if the call is not one
        self._stream: JsonCallStream | XmlCallStream | None = None  # a constrained call, streaming
        self._pending: str | None = None  # an unconstrained call, kept until it closes
        self._is_discarding = False  # a call past the one parallel_tool_calls=False allows
        self._is_after_call = False  # whitespace here is the template's, not text
        # hermes: the reply's start, until it is known not to be an untagged call
        self._untagged = UntaggedCall(log, tools, constrained) if syntax == "hermes" else None

    def feed(self, text: str) -> list[TurnEvent]:
        events: list[TurnEvent] = []
        if self._untagged is not None:
            events += self._untagged.feed(text)
            text = self._after_untagged()
        self._buffer += text
        while self._buffer:
            in_text = self._stream is None and self._pending is None
            if not (self._text(events) if in_text else self._call(events)):
                break
        return events

    def finish(self) -> list[TurnEvent]:
        events: list[TurnEvent] = []
        if self._untagged is not None:
            events += self._untagged.finish()
            events += self.feed(self._after_untagged())  # text: scanned for tagged calls
        if self._stream is not None:
            if self._stream.start is not None:
                events += self._stream.finish()
                self._buffer = ""
            else:
                self._pending, self._buffer = self._stream.raw + self._buffer, ""
            self._stream = None
        if self._pending is not None:
            if not self._is_discarding:
                self._emit(events, self._gap + self._open + self._pending + self._buffer)
        else:
            self._emit(events, self._buffer)
        self._buffer, self._pending = "", None
        return events

    def _after_untagged(self) -> str:
        """What the reply's start hands on once it is decided: all of it if it was text, or what
        followed its call; nothing while it is undecided."""
        untagged = self._untagged
        if untagged is None or not (untagged.is_text or untagged.is_done):
            return ""
        self._untagged, self._is_after_call = None, untagged.is_done
        return untagged.rest

    def _emit(self, events: list[TurnEvent], text: str) -> None:
        if self._is_after_call:
            text = text.lstrip()
            self._is_after_call = not text
        if text:
            events.append(TextDelta(text))

    def _text(self, events: list[TurnEvent]) -> bool:
        at = self._buffer.find(self._open)
        if at >= 0:
            text = self._buffer[:at]
            self._emit(events, text.rstrip())
            self._gap, self._buffer = text[len(text.rstrip()):], self._buffer[at + len(self._open):]
            self._is_discarding = not self._log.can_start
            if self._is_constrained and not self._is_discarding:
                self._stream = (JsonCallStream(self._log, self._tools, CALL_CLOSE) if self._syntax == "hermes"
                                else XmlCallStream(self._log, self._tools))
            else:
                self._pending = ""
            return True
        # Hold back what may open a call, and trailing whitespace (dropped if a call follows).
        held = partial_tag_length(self._buffer, self._open)
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
        at = self._pending.find(self._close)
        if at < 0:
            return False
        inner, self._buffer, self._pending = self._pending[:at], self._pending[at + len(self._close):], None
        if self._is_discarding:
            self._is_after_call = True
            return True
        whole = {"hermes": whole_json_call, "xml": whole_xml_call, "gemma4": whole_gemma_call}[self._syntax]
        call = whole(inner, self._tools)
        if call is None:
            self._emit(events, self._gap + self._open + inner + self._close)
        else:
            events += self._log.whole(*call)
            self._is_after_call = True
        return True


class Llama3Calls:
    """llama3: the whole reply is calls, `{...}; {...}` (after <|python_tag|>), when it opens with "{";
    otherwise it is text."""

    def __init__(self, syntax: str, tools: dict[str, Tool], log: CallLog, constrained: bool):
        self._tools, self._log, self._is_constrained = tools, log, constrained
        self._state = "start"  # start -> (call -> between)* -> text
        self._buffer = ""
        self._prefix = ""  # what came before this call since the last one: text again if it is not one
        self._stream: JsonCallStream | None = None
        self._object, self._extent, self._is_discarding = "", JsonExtent(), False

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
            self._stream = JsonCallStream(self._log, self._tools, "}")
        else:
            self._stream, self._object, self._extent = None, "", JsonExtent()

    def _call(self, events: list[TurnEvent]) -> None:
        if self._stream is not None:
            text, self._buffer = self._buffer, ""
            events += self._stream.feed(text)
            if self._stream.is_failed:
                self._stream, self._object, self._extent, self._buffer = None, "", JsonExtent(), self._stream.raw
            elif self._stream.is_done:
                self._state, self._buffer, self._stream = "between", self._stream.rest, None
            return
        end = self._extent.feed(self._buffer)
        self._object, self._buffer = self._object + self._buffer[:end], self._buffer[end:]
        if not self._extent.is_done:
            return
        call = whole_json_call(self._object, self._tools)
        if self._is_discarding:
            self._state = "between"
        elif call is None:
            self._state, self._buffer = "text", self._prefix + self._object + self._buffer
        else:
            events += self._log.whole(*call)
            self._state = "between"
