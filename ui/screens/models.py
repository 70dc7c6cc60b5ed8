"""ModelsScreen: the models chat can switch to (offline ones, cached conversions, the one running)."""

from __future__ import annotations

from typing import NamedTuple

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from tinymlx.loader import OFFLINE_MODELS
from tinymlx.loader.cache import format_bytes, list_cached_models


class ModelChoice(NamedTuple):
    name: str  # what --model takes
    description: str


def available_models() -> list[ModelChoice]:
    """The offline models (downloaded or not) and every local .gguf already converted in the cache."""
    cached = {model.name: model for model in list_cached_models()}
    choices = []
    for name, model in OFFLINE_MODELS.items():
        entry = cached.get(name)
        state = "downloaded" if entry is not None and entry.is_downloaded else f"downloads {format_bytes(model.size)}"
        choices.append(ModelChoice(name, f"{model.description} ({state})"))
    for entry in cached.values():
        ready = [c for c in entry.conversions if c.state == "ready"]
        if not entry.is_offline and ready:
            choices.append(ModelChoice(str(ready[0].path), f"{entry.description} (converted, cached)"))
    return choices


class ModelsScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "dismiss", "Close")]

    def __init__(self, choices: list[ModelChoice], current: str) -> None:
        super().__init__()
        self._choices, self._current = choices, current

    def compose(self) -> ComposeResult:
        with Vertical(id="models-box"):
            yield Label("Switch model", id="models-title")
            yield Label(f"Running: {self._current}. Enter switches; sessions keep their history.",
                        id="models-hint", markup=False)
            yield OptionList(*(Option(Content(f"{c.name}  ·  {c.description}"), id=str(i))
                               for i, c in enumerate(self._choices)))

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self._choices[int(event.option.id)].name)
