"""An untagged hermes call: the reply opens with the call's JSON itself, bare or in a ```json fence,
with no <tool_call> tags (Qwen2.5-Coder's habit under tool_choice "auto"):

    {"name": "get_weather", "arguments": {"city": "Paris"}}
    ```json\\n{\\n  "name": "get_weather",\\n  "arguments": {\\n    "city": "Paris"\\n  }\\n}\\n```

Only the reply's start opens one: once `{"name"` is read there (after whitespace and the fence).
Under the call grammar it is well formed and streams like a tagged call, its arguments as the model
wrote them (its whitespace kept, as for tagged calls). Without it the reply must be that one object
and nothing else but whitespace and the closing fence; it is checked whole at the end, and is the
text it was if it is not a call of a tool.
"""

from __future__ import annotations

from tinymlx.turns.call_markup import UNTAGGED_FENCE_CLOSE, UNTAGGED_FENCES, UNTAGGED_KEY
from tinymlx.turns.call_streams import CallLog, JsonCallStream, JsonExtent, whole_json_call
from tinymlx.turns.turn import Tool, TurnEvent

_WHITESPACE = " \t\r\n"


def untagged_opening(text: str) -> tuple[str, int] | str:
    """How a reply that begins with `text` opens: (its fence, where the call's "{" is) for an untagged
    call, "text" for anything else, "wait" while more of it may still decide."""
    rest = text.lstrip(_WHITESPACE)
    fence = next((fence for fence in UNTAGGED_FENCES if rest.startswith(fence)), "")
    if not fence and any(fence.startswith(rest) for fence in UNTAGGED_FENCES):
        return "wait"  # nothing but whitespace yet, or part of a fence
    rest = rest[len(fence):]
    if not rest:
        return "wait"
    if rest[0] != "{":
        return "text"
    key = rest[1:].lstrip(_WHITESPACE)
    if key.startswith(UNTAGGED_KEY):
        return fence, len(text) - len(rest)
    return "wait" if UNTAGGED_KEY.startswith(key) else "text"


class UntaggedCall:
    """The reply's start, read until it is known to be an untagged call or text. Then `is_text` (all
    of it, `rest`, is the reply's text to scan on) or `is_done` (`rest` is what followed the call)."""

    def __init__(self, log: CallLog, tools: dict[str, Tool], constrained: bool):
        self._log, self._tools, self._is_constrained = log, tools, constrained
        self._state = "start"  # start -> call -> tail -> done, or text from any of them
        self._raw = ""  # everything fed, the text it was if it is not a call
        self._fence = ""
        self._stream: JsonCallStream | None = None  # constrained: the call, streaming
        self._extent, self._object = JsonExtent(), ""  # unconstrained: the object, kept whole
        self._call: tuple[str, str] | None = None  # unconstrained: the call checked, ended by the end
        self._tail = ""  # after the object: whitespace and the closing fence
        self.rest = ""

    @property
    def is_text(self) -> bool:
        return self._state == "text"

    @property
    def is_done(self) -> bool:
        return self._state == "done"

    def feed(self, text: str) -> list[TurnEvent]:
        self._raw += text
        events: list[TurnEvent] = []
        if self._state == "start":
            text = self._open()
        if self._state == "call":
            text = self._read_call(text, events)
        if self._state == "tail":
            self._read_tail(text)
        return events

    def finish(self) -> list[TurnEvent]:
        """The end of the reply: the call (if the reply was one, or one cut short under the grammar),
        else the text it was."""
        events: list[TurnEvent] = []
        if self._stream is not None and self._stream.start is not None:
            events += self._stream.finish()
        elif self._state == "tail" and self._call is not None:
            if self._tail.strip(_WHITESPACE) in ("", UNTAGGED_FENCE_CLOSE if self._fence else ""):
                events += self._log.whole(*self._call)
            else:
                self._state = "text"  # a fence not closed, only begun
        elif self._state in ("start", "call"):
            self._state = "text"
        if self._state == "text":
            self.rest = self._raw
        else:
            self._state, self.rest = "done", ""
        return events

    def _open(self) -> str:
        """The reply's start: the call's text from its "{" once it is one, else ""."""
        opening = untagged_opening(self._raw)
        if opening == "text":
            self._state, self.rest = "text", self._raw
        if isinstance(opening, str):
            return ""
        self._fence, at = opening
        self._state = "call"
        if self._is_constrained:
            self._stream = JsonCallStream(self._log, self._tools, "}")
        return self._raw[at:]

    def _read_call(self, text: str, events: list[TurnEvent]) -> str:
        """The call's object; what follows it, returned, is the tail."""
        stream = self._stream
        if stream is not None:
            events += stream.feed(text)
            if stream.is_done:
                self._state, self._stream = "tail", None
                return stream.rest
            if not stream.is_failed:
                return ""
            text, self._stream = stream.raw, None  # never under the grammar: check it whole
        end = self._extent.feed(text)
        self._object += text[:end]
        if not self._extent.is_done:
            return ""
        self._call = whole_json_call(self._object, self._tools)
        if self._call is None:
            self._state, self.rest = "text", self._raw
            return ""
        self._state = "tail"
        return text[end:]

    def _read_tail(self, text: str) -> None:
        """After the object: whitespace, and the closing fence if one opened."""
        self._tail += text
        tail = self._tail.lstrip(_WHITESPACE)
        close = UNTAGGED_FENCE_CLOSE if self._fence else ""
        if self._call is None:  # streamed: the call has ended, drop its closing fence
            if len(tail) < len(close) and close.startswith(tail):
                return
            self._state, self.rest = "done", tail[len(close):] if tail.startswith(close) else self._tail
        elif not (close.startswith(tail) or (tail.startswith(close) and not tail[len(close):].strip(_WHITESPACE))):
            self._state, self.rest = "text", self._raw  # unconstrained: more than the call, so text
