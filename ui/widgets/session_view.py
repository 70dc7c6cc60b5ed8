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
                yield from self._footer(turn)
        yield PromptInput(id="prompt")

    def on_mount(self) -> None:
        self.show_settings()
        self.query_one("#conversation").anchor()  # keep the newest text in view until the user scrolls up

    def show_settings(self) -> None:
        self.query_one("#system-prompt", Static).update(f"system: {self.session.settings.system_prompt or '(none)'}")

    def set_prompt(self, text: str) -> None:
        """Put `text` in the prompt, cursor at its end, to edit and send again."""
        prompt = self.query_one(PromptInput)
        prompt.text = text
        prompt.move_cursor(prompt.document.end)
        self.focus_input()

    def focus_input(self) -> None:
        self.screen.set_focus(self.query_one(PromptInput))  # now, not after a refresh (see ChatScreen._activate)

    def _turn(self, role: str, content: str) -> Static | Markdown:
        if role == "user":
            return Static(content, classes="turn user", markup=False)
        reply = Markdown(printable(content), classes="turn assistant")
        reply.styles.border_left = ("outer", session_color(self.session.session_id))
        return reply

    @staticmethod
    def _footer(turn: dict) -> list[Static]:
        """Under a reply: why it was cut off, if it was, and its numbers (tokens, TTFT, rate, cache)."""
        lines = []
        if turn.get("note"):
            lines.append(Static(turn["note"], classes="note", markup=False))
        if turn.get("stats"):
            lines.append(Static(turn["stats"], classes="stats", markup=False))
        return lines

    def refuse_if_replying(self) -> bool:
        """True (with a notice) while a reply streams: one turn at a time per session."""
        if self.is_replying:
            self.notify("Still replying: Esc cancels the reply.", severity="warning")
        return self.is_replying

    async def on_prompt_input_submitted(self, event: PromptInput.Submitted) -> None:
        event.stop()
        if self.refuse_if_replying():
            return
        event.prompt_input.clear()
        await self.begin_reply(event.text)
        self.post_message(SendRequested(self.session.session_id, event.text))

    async def begin_reply(self, user_text: str | None) -> None:
        """Show the user's turn (None: regenerating after the turn already shown) and an empty reply."""
        self._reply, self._num_shown = self._turn("assistant", ""), 0
        conversation = self.query_one("#conversation")
        await conversation.mount_all(([self._turn("user", user_text)] if user_text is not None else []) + [self._reply])
        # Sending re-anchors to the bottom: had the user scrolled up to read, the anchor was released
        # and the new turn (and its reply) would land out of sight until they scrolled back down.
        conversation.anchor()
        self._stream = Markdown.get_stream(self._reply)

    async def drop_last_turns(self, num_turns: int) -> None:
        """Remove the last `num_turns` turns shown, with their notes and stats."""
        conversation = self.query_one("#conversation")
        children = list(conversation.children)
        turn_indices = [i for i, widget in enumerate(children) if widget.has_class("turn")]
        if num_turns:
            await conversation.remove_children(children[turn_indices[-num_turns]:])

    async def on_reply_updated(self, message: ReplyUpdated) -> None:
        await self._show(message.text)

    async def on_reply_finished(self, message: ReplyFinished) -> None:
        await self._show(message.text)
        if self._stream is not None:
            await self._stream.stop()
        conversation = self.query_one("#conversation")
        if message.error:  # the engine refused the turn: neither it nor a reply is shown; its text is kept
            if self._reply is not None:
                await self._reply.remove()
            await self.drop_last_turns(1)
            await conversation.mount(Static(f"error: {message.error}", classes="note", markup=False))
            if message.refused_text is not None and not self.query_one(PromptInput).text:
                self.set_prompt(message.refused_text)
        elif message.turn is not None:
            await conversation.mount_all(self._footer(message.turn))
        self._reply = self._stream = None

    async def _show(self, text: str) -> None:
        if self._stream is not None and len(text) > self._num_shown:
            await self._stream.write(printable(text[self._num_shown:]))
            self._num_shown = len(text)
