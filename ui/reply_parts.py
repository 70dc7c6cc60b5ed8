"""A streaming reply's thinking and its answer, read by the parser the server uses (<think>...</think>,
harmony's analysis and final channels)."""

from __future__ import annotations

from tinymlx.turns.reasoning import starts_in_reasoning
from tinymlx.turns.reply_format import PLAIN, ReplyFormat
from tinymlx.turns.turn import ReasoningDelta, TextDelta


class ReplyParts:
    """Feed the reply's text deltas; `reasoning` and `answer` are what they spell so far. `reply_format`:
    the chat template's (a base model's continuation is all answer); `prompt_text`: the rendered prompt,
    whose end says whether the reply starts inside a think block (Qwen3.5's generation prompt opens it)."""

    def __init__(self, reply_format: ReplyFormat = PLAIN, prompt_text: str = ""):
        self._parser = reply_format.parser(starts_in_reasoning=starts_in_reasoning(prompt_text))
        self.reasoning = ""
        self.answer = ""

    def feed(self, delta: str) -> None:
        self._take(self._parser.feed(delta))

    def finish(self) -> None:
        """The reply ended: what the parser held back (a possible partial tag) is the text it was."""
        if self._parser is not None:
            self._take(self._parser.finish())
            self._parser = None

    def _take(self, events) -> None:
        for event in events:
            if isinstance(event, ReasoningDelta):
                self.reasoning += event.text
            elif isinstance(event, TextDelta):
                self.answer += event.text
