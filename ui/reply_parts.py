"""A streaming reply's thinking and its answer, split as the server splits them (<think>...</think>)."""

from __future__ import annotations

from tinymlx.chat.reasoning import ReasoningSplitter, starts_in_reasoning
from tinymlx.chat.turns import ReasoningDelta


class ReplyParts:
    """Feed the reply's text deltas; `reasoning` and `answer` are what they spell so far. `thinks`: the
    chat template knows <think> (others' replies are all answer); `prompt_text`: the rendered prompt,
    whose end says whether the reply starts inside a think block (Qwen3.5's generation prompt opens it)."""

    def __init__(self, thinks: bool, prompt_text: str = ""):
        self._splitter = ReasoningSplitter(starts_in_reasoning(prompt_text)) if thinks else None
        self.reasoning = ""
        self.answer = ""

    def feed(self, delta: str) -> None:
        if self._splitter is None:
            self.answer += delta
        else:
            self._take(self._splitter.feed(delta))

    def finish(self) -> None:
        """The reply ended: what the splitter held back (a possible partial tag) is the text it was."""
        if self._splitter is not None:
            self._take(self._splitter.finish())
            self._splitter = None

    def _take(self, pieces) -> None:
        for piece in pieces:
            if isinstance(piece, ReasoningDelta):
                self.reasoning += piece.text
            else:
                self.answer += piece.text
