"""PromptInput: a multi-line input where Enter sends and Shift+Enter or Ctrl+J adds a newline."""

from __future__ import annotations

from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea


class PromptInput(TextArea):
    # Priority: TextArea would otherwise take Enter as a newline before any binding sees it.
    # Many terminals send Shift+Enter as plain Enter, so Ctrl+J (a literal line feed) is the sure one.
    # The placeholder says so; the footer keeps its room for the session keys.
    BINDINGS = [
        Binding("enter", "submit", "Send", tooltip="Send the message", priority=True, show=False),
        Binding("shift+enter,ctrl+j", "newline", "Newline", tooltip="New line in the message", priority=True,
                show=False),
    ]

    class Submitted(Message):
        def __init__(self, prompt_input: PromptInput, text: str) -> None:
            super().__init__()
            self.prompt_input, self.text = prompt_input, text

    def __init__(self, **kwargs) -> None:
        super().__init__(highlight_cursor_line=False, placeholder="Message (Enter sends, Ctrl+J adds a line)",
                         **kwargs)
        # A steady cursor: blinking redraws the screen twice a second, UI-thread time the engine's step loop
        # shares while replies stream (benchmarks/chat_overhead.py).
        self.cursor_blink = False

    def action_submit(self) -> None:
        if self.text.strip():
            self.post_message(self.Submitted(self, self.text.strip()))

    def action_newline(self) -> None:
        self.insert("\n")
