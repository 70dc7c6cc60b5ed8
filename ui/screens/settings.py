"""SettingsScreen: edit a session's system prompt, sampling parameters, stop strings and JSON output
(and turn the engine's disk cache off or on)."""

from __future__ import annotations

import re

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static, Switch, TextArea

from tinymlx_ui.session import SessionSettings

# (SessionSettings field, label, Input type): the grid, three to a row. Ranges are SamplingParams' to check.
NUMBER_FIELDS = [
    ("temperature", "Temperature", "number"),
    ("max_tokens", "Max tokens", "integer"),
    ("seed", "Seed (empty = none)", "integer"),
    ("top_p", "Top p", "number"),
    ("top_k", "Top k (0 = off)", "integer"),
    ("min_p", "Min p", "number"),
    ("repetition_penalty", "Repetition penalty", "number"),
    ("presence_penalty", "Presence penalty", "number"),
    ("frequency_penalty", "Frequency penalty", "number"),
]
STOP_LABEL = r"Stop strings, comma-separated (\n = newline)"
STOP_TIP = r"The reply ends before any of these. \, is a comma, \n a newline, \t a tab, \\ a backslash."
_ESCAPES = {"n": "\n", "t": "\t", ",": ",", "\\": "\\"}


def input_id(field: str) -> str:
    return field.replace("_", "-")


def format_stop(stop: tuple[str, ...]) -> str:
    """The one-line text parse_stop reads back: a newline shows as \\n, a comma inside a stop string as \\,."""
    escape = str.maketrans({"\\": "\\\\", ",": "\\,", "\n": "\\n", "\t": "\\t"})
    return ", ".join(s.translate(escape) for s in stop)


def parse_stop(text: str) -> tuple[str, ...]:
    """Comma-separated; spaces around each item are trimmed; \\n, \\t, \\, and \\\\ are escapes. An empty item
    (as in 'a,,b') is kept, for SamplingParams to refuse with its own message."""
    if not text.strip():
        return ()
    items, raw, escaped = [], "", False
    for ch in text:
        if ch == "," and not escaped:
            items.append(raw)
            raw = ""
        else:
            raw += ch
        escaped = ch == "\\" and not escaped
    items.append(raw)
    return tuple(re.sub(r"\\(.)", lambda m: _ESCAPES.get(m[1], m[0]), item.strip()) for item in items)


def parse_number(field: str, text: str, kind: str) -> float | int | None:
    """The typed text as a number; the range is left to SamplingParams. Only the seed may be empty (no seed)."""
    text = text.strip()
    if field == "seed" and not text:
        return None
    try:
        return float(text) if kind == "number" else int(text)
    except ValueError:
        what = "a number" if kind == "number" else "an integer"
        raise ValueError(f"{field} must be {what}, got {text!r}") from None


DISK_CACHE_TIP = ("The prefix cache's disk tier, for every session of this run: long prompts come back from disk "
                  "after a restart. Off: nothing is read or written (--no-disk-cache starts without it).")


class SettingsScreen(ModalScreen[SessionSettings | None]):
    BINDINGS = [Binding("escape", "dismiss", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, settings: SessionSettings, title: str, disk_cache: bool | None = None) -> None:
        """`disk_cache`: whether the engine's disk tier is on (None: it has none, and no switch shows);
        after a save, `disk_cache` holds the switch's value."""
        super().__init__()
        self._settings, self._title = settings, title
        self.disk_cache = disk_cache

    def compose(self) -> ComposeResult:
        s = self._settings
        with Vertical(id="settings-box"):
            yield Label(f"Settings: {self._title}", id="settings-title", markup=False)
            prompt = TextArea(s.system_prompt, id="system-prompt-input", soft_wrap=True)
            prompt.border_title = "System prompt"
            yield prompt
            with Grid(id="settings-fields"):
                # Labels sit in the inputs' borders: 3-row inputs keep 12 fields on a 30-row terminal.
                for field, label, kind in NUMBER_FIELDS:
                    value = getattr(s, field)
                    box = Input("" if value is None else str(value), type=kind, id=input_id(field))
                    box.border_title = label
                    yield box
                stop = Input(format_stop(s.stop), id="stop", tooltip=STOP_TIP)
                stop.border_title = STOP_LABEL
                yield stop
                with Horizontal(id="json-field"):
                    yield Label("JSON output")
                    yield Switch(s.json_output, id="json-output", tooltip="Replies are constrained to one JSON object")
            with Horizontal(classes="buttons"):
                if self.disk_cache is not None:  # engine-wide, so beside the buttons rather than among the fields
                    yield Label("Disk cache", id="disk-cache-label")
                    yield Switch(self.disk_cache, id="disk-cache", tooltip=DISK_CACHE_TIP)
                yield Static(id="settings-error", markup=False)
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)

    def action_save(self) -> None:
        try:
            numbers = {field: parse_number(field, self.query_one(f"#{input_id(field)}", Input).value, kind)
                       for field, _, kind in NUMBER_FIELDS}
            settings = SessionSettings(
                system_prompt=self.query_one("#system-prompt-input", TextArea).text.strip(),
                json_output=self.query_one("#json-output", Switch).value,
                stop=parse_stop(self.query_one("#stop", Input).value),
                **numbers,
            )
            settings.sampling_params()  # the engine's own validation, with its own message
        except ValueError as error:
            self.query_one("#settings-error", Static).update(str(error))
            return
        if self.disk_cache is not None:
            self.disk_cache = self.query_one("#disk-cache", Switch).value
        self.dismiss(settings)
