"""Tool calls out of generated text, as it streams: OutputParser runs the reasoning splitter first and
the call scanner of the template's syntax (hermes, xml, llama3: see call_markup.py) on the answer. A
harmony reply (gpt-oss: harmony.py) is read by its own reader instead: its channels carry both the
reasoning and the calls, and it is read so whether or not tools are on offer.

Under the call grammar (`constrained`) a call is well formed, so its arguments stream as they arrive:
its start (id, name) once the name is read, then the argument text, then its end at the closing tag.
Without it each call is kept until it closes and then checked: bad JSON, an unknown tool, an
unclosed call come back as the text they were, never as an error.

Whitespace around calls (before the first, between them, after the last) is not text: the templates
write their own, so a reply sent back renders the same bytes. Text after the calls is kept as text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tinymlx.turns.call_markup import CALL_OPEN, PYTHON_TAG
from tinymlx.turns.call_scanners import Llama3Calls, TaggedCalls
from tinymlx.turns.call_streams import CallLog, new_call_id
from tinymlx.turns.gemma_calls import is_gemma_template
from tinymlx.turns.harmony import HarmonyReader, is_harmony_template
from tinymlx.turns.reasoning import THINK_CLOSE, THINK_OPEN, ReasoningSplitter
from tinymlx.turns.turn import (
    ReasoningDelta,
    TextDelta,
    Tool,
    ToolArgumentsDelta,
    ToolCall,
    ToolCallStart,
    TurnEvent,
)

SYNTAXES = ("hermes", "xml", "llama3", "harmony", "gemma4")


def syntax_for_template(chat_template_source: str | None) -> str | None:
    """The call syntax a chat template teaches its model, read from the template's text."""
    source = chat_template_source or ""
    if is_harmony_template(source):
        return "harmony"
    if is_gemma_template(source):
        return "gemma4"
    if "<function=" in source:
        return "xml"
    if CALL_OPEN in source:
        return "hermes"
    if PYTHON_TAG in source or ('"parameters"' in source and "<|start_header_id|>" in source):
        return "llama3"
    return None


class OutputParser:
    """A reply's text as it streams -> TurnEvents: reasoning, text, and tool calls (start, argument
    pieces, end); `text`, `reasoning` and `tool_calls` hold the totals so far."""

    def __init__(self, syntax: str | None, tools: Sequence[Tool], starts_in_reasoning: bool = False,
                 constrained: bool = False, parallel_tool_calls: bool = True,
                 new_call_id: Callable[[], str] = new_call_id,
                 splits_reasoning: bool = True, reasoning_tags: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)):
        if syntax is not None and syntax not in SYNTAXES:
            raise ValueError(f"unknown tool-call syntax {syntax!r}; choose one of {', '.join(SYNTAXES)}")
        # Qwen3.5 may open its call inside reasoning without closing it; the call grammar never does.
        implicit_end = CALL_OPEN + "\n<function=" if syntax == "xml" and not constrained else None
        self._splitter = (ReasoningSplitter(starts_in_reasoning, implicit_end, reasoning_tags)
                          if (splits_reasoning or starts_in_reasoning) and syntax != "harmony" else None)
        log = CallLog(new_call_id, parallel_tool_calls)
        by_name = {tool.name: tool for tool in tools}
        scanner = {"llama3": Llama3Calls, "harmony": HarmonyReader}.get(syntax, TaggedCalls)
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
            if isinstance(piece, TextDelta) and self._calls is not None:  # (harmony's reader takes it all)
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
