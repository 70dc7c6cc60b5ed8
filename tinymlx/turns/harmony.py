"""gpt-oss's harmony format: a reply is a run of messages, each on a channel, read as it streams.

    <|channel|>analysis<|message|>The user asks...<|end|>               reasoning
    <|start|>assistant<|channel|>final<|message|>Paris.<|return|>        the answer
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":
    "Paris"}<|call|>                                                      a tool call

The prompt ends in `<|start|>assistant`, so the reply opens with its first message's header. The markup is
control tokens: the reply is detokenized with them kept (`skip_special_tokens=False`) for this reader.
A header names the channel and, for a call, the recipient (`to=functions.NAME`, before or after the
channel); its content type (`<|constrain|>json`, ` json`) is ignored. A commentary message without a
recipient is a preamble the user sees: text. Text outside any header (a model that skips the markup) is
text too, so nothing the model writes is lost.

Under the call grammar a call is well formed: its arguments stream as they arrive. Without it a call is kept
until its message ends and checked whole: bad JSON, an unknown tool or a recipient outside `functions` come
back as the text they were.
"""

from __future__ import annotations

import re

from tinymlx.turns.call_streams import CallLog
from tinymlx.turns.reasoning import partial_tag_length
from tinymlx.turns.tool_schema import json_text, json_value
from tinymlx.turns.turn import ReasoningDelta, TextDelta, Tool, ToolArgumentsDelta, ToolCallEnd, TurnEvent

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
END_OF_TEXT = "<|endoftext|>"
FUNCTIONS = "functions."
# What ends a message's content: its own end, the reply's end, or (a model that skipped <|end|>) a new header.
_CONTENT_ENDS = (END, RETURN, CALL, END_OF_TEXT, START, CHANNEL)
_REPLY_ENDS = (RETURN, CALL, END_OF_TEXT)
_HEADER_OPENINGS = (START, CHANNEL, " to=")  # how a header may start
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


def is_harmony_template(chat_template_source: str | None) -> bool:
    """A template that writes harmony's messages (gpt-oss's)."""
    source = chat_template_source or ""
    return CHANNEL in source and "<|start|>assistant" in source


class HarmonyReader:
    """A harmony reply's text as it streams -> TurnEvents (reasoning, text, calls)."""

    def __init__(self, syntax: str, tools: dict[str, Tool], log: CallLog, constrained: bool):
        self._tools, self._log, self._is_constrained = tools, log, constrained
        self._buffer = ""
        self._is_first_header = True  # only the reply's start may turn out to be plain text
        self._state = "header"  # header -> content -> (header -> content)* -> done
        self._kind = "text"  # the content's: "reasoning" | "text" | "call" | "discard"
        self._call_name = ""
        self._call_index = -1  # a streamed call's index once started
        self._pending = ""  # an unconstrained call's content, checked once its message ends

    def feed(self, text: str) -> list[TurnEvent]:
        self._buffer += text
        events: list[TurnEvent] = []
        while self._buffer and self._state != "done":
            before = (self._state, len(self._buffer))
            if self._state == "header":
                self._header()
            else:
                events += self._content()
            if (self._state, len(self._buffer)) == before:
                break  # waiting for more text
        return events

    def finish(self) -> list[TurnEvent]:
        """The reply ended (its end token, max_tokens or an abort): what was held back, and the end of a call."""
        events: list[TurnEvent] = []
        if self._state == "header":  # a header cut short says nothing to the reader
            self._buffer = ""
        elif self._state == "content":
            rest, self._buffer = self._buffer, ""
            events += self._piece(rest)
            events += self._end_message()
        self._state = "done"
        return events

    def _header(self) -> None:
        at = self._buffer.find(MESSAGE)
        if at < 0:
            opening = self._buffer.lstrip("\n")
            if self._is_first_header and opening and not any(
                    opening.startswith(o) or o.startswith(opening) for o in _HEADER_OPENINGS):
                self._open("text", "")  # no markup: the model writes plain text
            return
        header, self._buffer = self._buffer[:at], self._buffer[at + len(MESSAGE):]
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient is None:
            self._open("reasoning" if channel is not None and channel.group(1) == "analysis" else "text", "")
        else:
            self._open("call", recipient.group(1))

    def _open(self, kind: str, recipient: str) -> None:
        self._state, self._kind, self._pending, self._call_index = "content", kind, "", -1
        self._is_first_header = False
        if kind != "call":
            return
        name = recipient.removeprefix(FUNCTIONS) if recipient.startswith(FUNCTIONS) else None
        if not self._log.can_start:
            self._kind = "discard"  # a call past the one parallel_tool_calls=False allows
        elif name not in self._tools:
            self._kind, self._pending = "text", ""  # a recipient we cannot call: its content is text
        self._call_name = name or ""

    def _content(self) -> list[TurnEvent]:
        ends = [(self._buffer.find(tag), tag) for tag in _CONTENT_ENDS]
        found = [(at, tag) for at, tag in ends if at >= 0]
        if not found:
            held = max(partial_tag_length(self._buffer, tag) for tag in _CONTENT_ENDS)
            piece, self._buffer = self._buffer[:len(self._buffer) - held], self._buffer[len(self._buffer) - held:]
            return self._piece(piece)
        at, tag = min(found)
        piece = self._buffer[:at]
        # <|end|> and the reply's ends are consumed; a header that follows is read as one.
        self._buffer = self._buffer[at + len(tag):] if tag in (END, *_REPLY_ENDS) else self._buffer[at:]
        events = self._piece(piece) + self._end_message()
        self._state = "done" if tag in _REPLY_ENDS else "header"  # (the header's regexes skip its role)
        return events

    def _piece(self, text: str) -> list[TurnEvent]:
        if not text:
            return []
        if self._kind == "reasoning":
            return [ReasoningDelta(text)]
        if self._kind == "text":
            return [TextDelta(text)]
        if self._kind == "discard":
            return []
        if not self._is_constrained:
            self._pending += text
            return []
        events: list[TurnEvent] = []
        if self._call_index < 0:
            start = self._log.start(self._call_name)
            self._call_index = start.index
            events.append(start)
        return events + [ToolArgumentsDelta(self._call_index, text)]

    def _end_message(self) -> list[TurnEvent]:
        if self._kind != "call":
            return []
        if self._is_constrained:
            return [ToolCallEnd(self._call_index)] if self._call_index >= 0 else []
        try:
            arguments = json_value(self._pending.strip())
        except (ValueError, RecursionError):
            arguments = None
        if not isinstance(arguments, dict):
            return [TextDelta(self._pending)] if self._pending else []
        return self._log.whole(self._call_name, json_text(arguments))
