"""SessionView: one session's conversation, its streaming reply and its prompt input."""

from __future__ import annotations

import re

from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Markdown, Static
from textual.widgets.markdown import MarkdownStream

from tinymlx_ui.messages import ReplyFinished, ReplyUpdated, SendRequested
from tinymlx_ui.session import ChatSession
from tinymlx_ui.widgets.colors import session_color
from tinymlx_ui.widgets.prompt_input import PromptInput

# Model output is untrusted text: control characters (ESC above all) must never reach the terminal.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def printable(text: str) -> str:
    return _CONTROL.sub("\N{REPLACEMENT CHARACTER}", text)


class SessionView(Vertical):
    def __init__(self, session: ChatSession, **kwargs) -> None:
        super().__init__(**kwargs)
        self.session = session
        self._reply: Markdown | None = None
        self._stream: MarkdownStream | None = None
        self._num_shown = 0  # characters of the reply already written to the stream

    @property
    def is_replying(self) -> bool:
        return self._reply is not None

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="conversation"):
            yield Static(id="system-prompt", markup=False)
            for turn in self.session.turns:
                yield self._turn(turn["role"], turn["content"])
        yield PromptInput(id="prompt")

    def on_mount(self) -> None:
        self.show_settings()
        self.query_one("#conversation").anchor()  # keep the newest text in view until the user scrolls up

    def show_settings(self) -> None:
        self.query_one("#system-prompt", Static).update(f"system: {self.session.settings.system_prompt or '(none)'}")

    def focus_input(self) -> None:
        self.screen.set_focus(self.query_one(PromptInput))  # now, not after a refresh (see ChatScreen._activate)

    def _turn(self, role: str, content: str) -> Static | Markdown:
        if role == "user":
            return Static(content, classes="turn user", markup=False)
        reply = Markdown(printable(content), classes="turn assistant")
        reply.styles.border_left = ("outer", session_color(self.session.session_id))
        return reply

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        event.stop()
        if self.is_replying:
            self.notify("Still replying: Esc cancels the reply.", severity="warning")
            return
        event.prompt_input.clear()
        self._reply, self._num_shown = self._turn("assistant", ""), 0
        await self.query_one("#conversation").mount_all([self._turn("user", event.text), self._reply])
        self._stream = Markdown.get_stream(self._reply)
        self.post_message(SendRequested(self.session.session_id, event.text))

    async def on_reply_updated(self, message: ReplyUpdated) -> None:
        await self._show(message.text)

    async def on_reply_finished(self, message: ReplyFinished) -> None:
        await self._show(message.text)
        if self._stream is not None:
            await self._stream.stop()
        if message.error and self._reply is not None:
            await self._reply.remove()  # the engine refused the turn: no reply to show
        notes = {"abort": "(cancelled)", "length": "(stopped at max tokens)"}
        note = f"error: {message.error}" if message.error else notes.get(message.finish_reason or "")
        if note:
            await self.query_one("#conversation").mount(Static(note, classes="note", markup=False))
        self._reply = self._stream = None

    async def _show(self, text: str) -> None:
        if self._stream is not None and len(text) > self._num_shown:
            await self._stream.write(printable(text[self._num_shown:]))
            self._num_shown = len(text)
