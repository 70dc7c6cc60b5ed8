"""SettingsScreen: edit a session's system prompt, temperature, max tokens and JSON output."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Static, Switch, TextArea

from tinymlx_ui.session import SessionSettings


class SettingsScreen(ModalScreen[SessionSettings | None]):
    BINDINGS = [Binding("escape", "dismiss", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(self, settings: SessionSettings, title: str) -> None:
        super().__init__()
        self._settings, self._title = settings, title

    def compose(self) -> ComposeResult:
        s = self._settings
        with Vertical(id="settings-box"):
            yield Label(f"Settings: {self._title}", id="settings-title", markup=False)
            yield Label("System prompt")
            yield TextArea(s.system_prompt, id="system-prompt-input", soft_wrap=True)
            with Horizontal(classes="fields"):
                yield Label("Temperature")
                yield Input(str(s.temperature), type="number", id="temperature")
                yield Label("Max tokens")
                yield Input(str(s.max_tokens), type="integer", id="max-tokens")
            with Horizontal(classes="fields"):
                yield Label("JSON output")
                yield Switch(s.json_output, id="json-output", tooltip="Replies are constrained to one JSON object")
            yield Static(id="settings-error", markup=False)
            with Horizontal(classes="buttons"):
                yield Button("Save", variant="primary", id="save")
                yield Button("Cancel", id="cancel")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.dismiss(None)

    def action_save(self) -> None:
        try:
            settings = SessionSettings(
                system_prompt=self.query_one("#system-prompt-input", TextArea).text.strip(),
                temperature=float(self.query_one("#temperature", Input).value),
                max_tokens=int(self.query_one("#max-tokens", Input).value),
                json_output=self.query_one("#json-output", Switch).value,
            )
            settings.sampling_params()  # the engine's own validation, with its own message
        except ValueError as error:
            self.query_one("#settings-error", Static).update(str(error))
            return
        self.dismiss(settings)
