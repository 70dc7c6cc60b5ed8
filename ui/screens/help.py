"""HelpScreen: every key, read from the bindings themselves so the list cannot drift from them."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, Static


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q,question_mark", "dismiss", "Close")]

    def __init__(self, rows: list[tuple[str, str]]) -> None:
        """rows: (keys, what they do)."""
        super().__init__()
        self._rows = rows

    def compose(self) -> ComposeResult:
        with Vertical(id="help-box"):
            yield Label("tinymlx chat: keys", id="help-title")
            with Grid(id="help-keys"):
                for keys, description in self._rows:
                    yield Label(keys, classes="keys", markup=False)
                    yield Label(description, markup=False)
            yield Static("Sessions generate at the same time: the engine panel shows them sharing one batch "
                         "and one KV pool. Esc closes this help.", classes="hint")
