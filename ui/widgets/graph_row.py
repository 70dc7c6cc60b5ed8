"""GraphRow: a caption with the current value beside a sparkline of its recent history."""

from __future__ import annotations

from collections.abc import Sequence

from textual.app import ComposeResult
from textual.color import Color
from textual.containers import Horizontal
from textual.widgets import Label, Sparkline


class GraphRow(Horizontal):
    def __init__(self, caption: str, color: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self._caption, self._color = caption, color

    def compose(self) -> ComposeResult:
        yield Label(self._caption, classes="caption", markup=False)
        color = Color.parse(self._color)
        yield Sparkline([], min_color=color.with_alpha(0.35), max_color=color)

    def show(self, values: Sequence[float], caption: str) -> None:
        self.query_one(Label).update(caption)
        self.query_one(Sparkline).data = values  # reassigned, never mutated: reactive needs a new object
