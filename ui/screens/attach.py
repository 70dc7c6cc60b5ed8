"""AttachScreen: a path to an image for the message being written; the chat reads and measures it."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, Static


class AttachScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "dismiss", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical(id="attach-box"):
            yield Label("Attach an image", id="attach-title")
            yield Input(placeholder="~/Pictures/screenshot.png", id="attach-path")
            yield Static("PNG, JPEG, WebP, GIF or BMP; several paths separated by spaces. Enter attaches, Esc "
                         "cancels. Dragging a file into the terminal attaches it too.", classes="hint")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value.strip() or None)
