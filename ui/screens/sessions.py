"""SessionsScreen: every saved session, most recent first; pick one to reopen it."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from tinymlx_ui.store import SessionSummary


def describe(summary: SessionSummary) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(summary.updated))
    state = "  (open)" if summary.is_open else ""
    return f"{summary.title}  ·  {summary.num_turns} messages  ·  {when}{state}"


class SessionsScreen(ModalScreen[int | None]):
    BINDINGS = [Binding("escape", "dismiss", "Close")]

    def __init__(self, summaries: list[SessionSummary]) -> None:
        super().__init__()
        self._summaries = summaries

    def compose(self) -> ComposeResult:
        with Vertical(id="sessions-box"):
            yield Label("Sessions: Enter opens one", id="sessions-title")
            yield OptionList(*(Option(Content(describe(s)), id=str(s.session_id)) for s in self._summaries))

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))
