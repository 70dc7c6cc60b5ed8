"""PromptInput: a multi-line input where Enter sends and Shift+Enter or Ctrl+J adds a newline.

Keys keep their order even when they come in one burst (fast typing, an IME, `tmux send-keys`, a terminal
without bracketed paste). The App hands each key on to this widget's queue, but a priority binding runs
in the App at once, ahead of the keys still queued here, and a plain binding runs once the key has
bubbled back up to the App, behind keys queued after it. So this widget runs its own bindings (Enter,
Ctrl+J, and TextArea's: Backspace, the arrows) in its own queue, each in its key's turn (issue #40).
"""

from __future__ import annotations

from pathlib import Path

from textual import events
from textual.binding import Binding
from textual.message import Message
from textual.widgets import TextArea

from tinymlx_ui.attachments import pasted_image_paths


class PromptInput(TextArea):
    # Not priority bindings, which would run ahead of the keys typed before them: _on_key runs them.
    # Many terminals send Shift+Enter as plain Enter, so Ctrl+J (a literal line feed) is the sure one.
    # The placeholder says so; the footer keeps its room for the session keys.
    BINDINGS = [
        Binding("enter", "submit", "Send", tooltip="Send the message", show=False),
        Binding("shift+enter,ctrl+j", "newline", "Newline", tooltip="New line in the message", show=False),
    ]

    class Submitted(Message):
        """Enter: `text` is "" when the box is blank (a message may be images alone: the session decides)."""

        def __init__(self, prompt_input: PromptInput, text: str) -> None:
            super().__init__()
            self.prompt_input, self.text = prompt_input, text

    class ImagesPasted(Message):
        """A paste that named image files (a terminal pastes a dragged file as its path): attach, not insert."""

        def __init__(self, prompt_input: PromptInput, paths: list[Path]) -> None:
            super().__init__()
            self.prompt_input, self.paths = prompt_input, paths

    def __init__(self, **kwargs) -> None:
        super().__init__(highlight_cursor_line=False,
                         placeholder="Message (Enter sends, Ctrl+J adds a line, Ctrl+F an image)", **kwargs)
        # A steady cursor: blinking redraws the screen twice a second, UI-thread time the engine's step loop
        # shares while replies stream (benchmarks/chat_overhead.py).
        self.cursor_blink = False

    async def _on_key(self, event: events.Key) -> None:
        # Textual calls this before TextArea._on_key, in the key's turn among the keys queued here. _bindings
        # holds this widget's and TextArea's bindings (ChatApp sets no keymap that would move them).
        for binding in self._bindings.key_to_bindings.get(event.key, ()):
            if await self.app.run_action(binding.action, self):
                event.prevent_default()  # TextArea would insert Enter as a newline
                event.stop()  # the App would run the binding a second time
                return

    async def _on_paste(self, event: events.Paste) -> None:
        # Runs before TextArea's handler, which prevent_default() skips.
        paths = pasted_image_paths(event.text)
        if paths:
            event.prevent_default()
            self.post_message(self.ImagesPasted(self, paths))

    def action_submit(self) -> None:
        text = self.text.strip()
        if text:
            # Taken out of the box now: the keys queued behind this Enter are the next message's, and
            # clearing later, when the message is handled, would throw them away.
            self.clear()
        self.post_message(self.Submitted(self, text))

    def put_back(self, text: str) -> None:
        """Return a message that could not be sent, ahead of whatever was typed since it left the box."""
        if self.text:
            self.insert(f"{text}\n", (0, 0))  # the cursor stays where the user is typing
        else:
            self.insert(text)

    def action_newline(self) -> None:
        self.insert("\n")
