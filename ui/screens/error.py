"""ErrorScreen: the model could not be loaded; say why, plainly, and let the user quit."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Center, Middle, Vertical
from textual.screen import Screen
from textual.widgets import Footer, Label, Static


class ErrorScreen(Screen):
    BINDINGS = [Binding("q,escape", "app.quit", "Quit")]

    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error

    def compose(self) -> ComposeResult:
        with Middle(), Center(), Vertical(id="error-box"):
            yield Label("Could not load the model", id="error-title")
            yield Static(self.error, id="error-message", markup=False)
            yield Static("Check --model: a model directory, a .gguf file, an offline model name "
                         "(`tinymlx models` lists them) or a Hugging Face repo id.")
        yield Footer()
