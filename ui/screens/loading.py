"""LoadingScreen: shown while the model loads (or downloads) on a background thread."""

from __future__ import annotations

import time

from textual.app import ComposeResult
from textual.containers import Center, Middle
from textual.screen import Screen
from textual.widgets import Label, LoadingIndicator


class LoadingScreen(Screen):
    def __init__(self, model_label: str) -> None:
        super().__init__()
        self._model_label = model_label
        self._started = time.monotonic()

    def compose(self) -> ComposeResult:
        with Middle(), Center():
            yield Label(f"Loading {self._model_label}", id="loading-title", markup=False)
            yield LoadingIndicator()
            yield Label("", id="elapsed")

    def on_mount(self) -> None:
        self.set_interval(0.5, self._tick)

    def _tick(self) -> None:
        # The first start may fetch and convert the model: say that a long wait is expected.
        elapsed = time.monotonic() - self._started
        hint = "  (the first start downloads the model)" if elapsed > 10 else ""
        self.query_one("#elapsed", Label).update(f"{elapsed:.0f}s{hint}  ·  ctrl+q quits")
