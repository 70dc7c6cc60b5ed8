"""Reasoning apart from the answer: `<think>...</think>` split off generated text as it streams.

    "<think>\\nLet me see.\\n</think>\\n\\nParis."  ->  ReasoningDelta("Let me see."), TextDelta("Paris.")

Newlines: the newlines right after `<think>`, right before `</think>` and right after `</think>` are
dropped. That is what Qwen3's chat template does when it renders an earlier turn
(`reasoning_content.strip('\\n')`, `content.lstrip('\\n')`, between its own `<think>\\n`,
`\\n</think>\\n\\n`), so a reply sent back renders the bytes the model wrote and the next turn reuses
its blocks. (vLLM's qwen3 parser passes them through; clients then strip them themselves.)

A reasoning block only opens at the start of the reply (after whitespace): `<think>` further on is
text. The prompt may have opened it already (Qwen3.5's and Qwen3-thinking's generation prompts end in
`<think>\\n`): then the reply starts inside, and a `<think>` the model repeats is dropped.
"""

from __future__ import annotations

from tinymlx.turns.turn import ReasoningDelta, TextDelta

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def starts_in_reasoning(prompt_text: str) -> bool:
    """Whether the generation starts inside reasoning: the prompt (or its last few tokens, decoded with
    their special tokens) ends in an opened `<think>`. A closed `<think>\\n\\n</think>\\n\\n`, as
    templates write with enable_thinking=False, is not open."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


def partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that could be the start of `tag` (held back until the
    next chunk says whether the tag follows)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class ReasoningSplitter:
    """Feeds generated text in chunks; returns what of it is reasoning and what is the answer.

    Only a possible partial tag and a run of newlines (which are dropped if a tag follows) are held
    back. `implicit_end`, if set, also ends reasoning and goes to the answer itself: Qwen3.5 sometimes
    opens its call (`<tool_call>\\n<function=`) without closing `</think>` first. `tags`: the block's
    opening and closing (Gemma 4's are `<|channel>thought` and `<channel|>`)."""

    def __init__(self, starts_inside: bool, implicit_end: str | None = None,
                 tags: tuple[str, str] = (THINK_OPEN, THINK_CLOSE)):
        self._open, self._close = tags
        self._state = "start"  # start -> (inside ->) answer
        self._opens_inside = starts_inside  # where "start" goes when no <think> opens the reply
        self._implicit_end = implicit_end
        self._buffer = ""
        self._is_fresh = True  # nothing emitted yet in this state (its leading newlines are dropped)

    def feed(self, text: str) -> list[TextDelta | ReasoningDelta]:
        self._buffer += text
        out: list[TextDelta | ReasoningDelta] = []
        while self._buffer:
            before = (self._state, len(self._buffer))
            if self._state == "start":
                self._start()
            elif self._state == "inside":
                out += self._inside()
            else:
                out += self._answer()
            if (self._state, len(self._buffer)) == before:
                break  # waiting for more text
        return out

    def finish(self) -> list[TextDelta | ReasoningDelta]:
        """What is still held: a partial tag is text of its part; trailing newlines of reasoning drop."""
        rest, self._buffer = self._buffer, ""
        if self._state == "start" and not self._opens_inside:
            return [TextDelta(rest)] if rest else []
        if self._state != "answer":
            rest = rest.strip("\n") if self._is_fresh else rest.rstrip("\n")
            return [ReasoningDelta(rest)] if rest else []
        rest = rest.lstrip("\n") if self._is_fresh else rest
        return [TextDelta(rest)] if rest else []

    def _enter(self, state: str) -> None:
        self._state, self._is_fresh = state, True

    def _start(self) -> None:
        stripped = self._buffer.lstrip()
        if stripped.startswith(self._open):
            self._buffer = stripped[len(self._open):]
            self._enter("inside")
        elif not self._open.startswith(stripped):  # (an empty `stripped` waits too)
            self._enter("inside" if self._opens_inside else "answer")

    def _inside(self) -> list[ReasoningDelta | TextDelta]:
        if self._is_fresh:
            self._buffer = self._buffer.lstrip("\n")
            if not self._buffer:
                return []
            self._is_fresh = False
        ends = [(self._buffer.find(tag), tag) for tag in (self._close, self._implicit_end) if tag]
        found = [(at, tag) for at, tag in ends if at >= 0]
        if found:
            at, tag = min(found)
            reasoning = self._buffer[:at].rstrip("\n")
            # </think> is dropped with the newlines after it; an implicit end is the answer's start.
            self._buffer = self._buffer[at + len(tag):] if tag == self._close else self._buffer[at:]
            self._enter("answer")
            self._is_fresh = tag == self._close
            return [ReasoningDelta(reasoning)] if reasoning else []
        held = max(partial_tag_length(self._buffer, tag) for _, tag in ends)
        body = self._buffer[: len(self._buffer) - held]
        kept = len(body.rstrip("\n"))
        if kept == 0:
            return []
        reasoning, self._buffer = self._buffer[:kept], self._buffer[kept:]
        return [ReasoningDelta(reasoning)]

    def _answer(self) -> list[TextDelta]:
        if self._is_fresh:
            self._buffer = self._buffer.lstrip("\n")
            if not self._buffer:
                return []
            self._is_fresh = False
        text, self._buffer = self._buffer, ""
        return [TextDelta(text)]
