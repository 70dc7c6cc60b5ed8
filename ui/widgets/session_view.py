"""SessionView: one session's conversation, its streaming reply and its prompt input.

A reply redraws at most REPLY_INTERVAL_S apart, however fast tokens come, and only its new text is
parsed: each redraw costs UI-thread time, and the UI thread shares the CPU and the GIL with the engine's
step loop. A session in a background tab does not redraw at all; shown, it catches up.
"""

from __future__ import annotations

import re
import time

from markdown_it import MarkdownIt
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.timer import Timer
from textual.widgets import Collapsible, Markdown, Static

from tinymlx_ui.attachments import Attachment
from tinymlx_ui.messages import ReplyFinished, ReplyUpdated, SendRequested
from tinymlx_ui.session import ChatSession
from tinymlx_ui.widgets.colors import session_color
from tinymlx_ui.widgets.image_chips import AttachmentChip, AttachmentTray, SentImages
from tinymlx_ui.widgets.prompt_input import PromptInput
from tinymlx_ui.widgets.reply_markdown import ReplyMarkdown

# Model output is untrusted text: control characters (ESC above all) must never reach the terminal.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


# The reply in view: up to 3 redraws a second, still live to read along. Each redraw is a frame (the reply's
# rows, and now and then a relayout), and on a 2-core machine each ms of it is taken from the engine's
# matmuls (benchmarks/chat_overhead.py); at 4 a second, a token a stream every 0.25-0.5 s merged none.
REPLY_INTERVAL_S = 1 / 3

_PARSER = MarkdownIt("gfm-like")  # Textual's default, built once (it builds one per append); parsing keeps no state


def printable(text: str) -> str:
    return _CONTROL.sub("\N{REPLACEMENT CHARACTER}", text)


class SessionView(Vertical):
    def __init__(self, session: ChatSession, sees_images: bool = True, **kwargs) -> None:
        """`sees_images`: whether the model takes images (its chips say a text model gets a note instead)."""
        super().__init__(**kwargs)
        self.session, self.sees_images = session, sees_images
        self._reply: ReplyMarkdown | None = None
        self._text = ""  # the reply's answer so far, as received
        self._reasoning = ""  # its thinking so far (models whose template knows <think>)
        self._thinking: Collapsible | None = None  # the streaming reply's thinking, open until the answer starts
        self._num_shown = 0  # characters of it already in the Markdown widget
        self._last_shown = 0.0  # time.monotonic() of the latest redraw
        self._redraw: Timer | None = None  # a redraw waiting for its interval to pass
        self.num_redraws = 0  # of streaming replies, since mount

    @property
    def is_replying(self) -> bool:
        return self._reply is not None

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="conversation"):
            yield Static(id="system-prompt", markup=False)
            for turn in self.session.turns:
                if turn.get("reasoning"):
                    yield self._thinking_widget(turn["reasoning"], collapsed=True)
                if turn["role"] == "user":
                    yield from self._user_turn(turn["content"], turn.get("images", ()))
                else:
                    yield self._turn(turn["role"], turn["content"])
                yield from self._footer(turn)
        yield AttachmentTray(self.sees_images, id="attachments")
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

    @property
    def attachments(self) -> tuple[Attachment, ...]:
        """The images attached to the message being written."""
        return self.query_one(AttachmentTray).attachments

    def set_attachments(self, attachments: tuple[Attachment, ...]) -> None:
        self.query_one(AttachmentTray).attachments = attachments

    def on_attachment_chip_removed(self, message: AttachmentChip.Removed) -> None:
        self.focus_input()  # the chip that had focus is gone; AttachmentTray has dropped its image

    def focus_input(self) -> None:
        self.screen.set_focus(self.query_one(PromptInput))  # now, not after a refresh (see ChatScreen._activate)

    def _user_turn(self, text: str, images: tuple[Attachment, ...]) -> list[Static | SentImages]:
        """A sent message: its text, and its images' chips under it in the same box."""
        if not images:
            return [self._turn("user", text)]
        return [self._turn("user", text).add_class("-with-images"),
                SentImages(images, self.sees_images, classes="sent-images")]

    def _turn(self, role: str, content: str, streaming: bool = False) -> Static | Markdown:
        if role == "user":
            return Static(content, classes="turn user", markup=False)
        reply = ReplyMarkdown(printable(content), streaming=streaming, classes="turn assistant",
                              parser_factory=lambda: _PARSER)
        reply.styles.border_left = ("outer", session_color(self.session.session_id))
        return reply

    @staticmethod
    def _thinking_widget(reasoning: str, collapsed: bool) -> Collapsible:
        """A reply's thinking: live while the model thinks, folded away once the answer starts."""
        title = "Thought" if collapsed else "Thinking…"
        return Collapsible(Static(printable(reasoning), markup=False, classes="thinking-text"), title=title,
                           collapsed=collapsed, classes="thinking")

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
        images = self.attachments
        if not event.text and not images:
            return  # a blank box: nothing to send
        if self.refuse_if_replying():
            if event.text:
                event.prompt_input.put_back(event.text)  # the prompt let go of it when Enter was pressed
            return  # the images stay attached
        self.set_attachments(())
        await self.begin_reply(event.text, images)
        self.post_message(SendRequested(self.session.session_id, event.text, images=images))

    async def begin_reply(self, user_text: str | None, images: tuple[Attachment, ...] = (),
                          num_dropped_turns: int = 0) -> None:
        """Show the user's turn with its images (None: regenerating after the turn already shown) and an empty
        reply, in place of the last `num_dropped_turns` turns shown."""
        # Replying from here, before the first await: a message sent meanwhile (its Enter typed just before a
        # Ctrl+R, which runs ahead of the keys queued in the prompt) is refused and kept, not begun beside it.
        self._reply, self._text, self._num_shown = self._turn("assistant", "", streaming=True), "", 0
        self._reasoning, self._thinking = "", None
        await self.drop_last_turns(num_dropped_turns)
        conversation = self.query_one("#conversation")
        user_turn = self._user_turn(user_text, images) if user_text is not None else []
        await conversation.mount_all([*user_turn, self._reply])
        # Sending re-anchors to the bottom: had the user scrolled up to read, the anchor was released
        # and the new turn (and its reply) would land out of sight until they scrolled back down.
        conversation.anchor()

    async def drop_last_turns(self, num_turns: int) -> None:
        """Remove the last `num_turns` turns shown, with their notes and stats."""
        conversation = self.query_one("#conversation")
        children = list(conversation.children)
        turn_indices = [i for i, widget in enumerate(children) if widget.has_class("turn")]
        if num_turns:
            await conversation.remove_children(children[turn_indices[-num_turns]:])

    async def on_reply_updated(self, message: ReplyUpdated) -> None:
        self._text, self._reasoning = message.text, message.reasoning
        if self._redraw is not None or not self._in_view():
            return  # the redraw already waiting shows this text too; a hidden view draws it when shown
        wait = self._last_shown + REPLY_INTERVAL_S - time.monotonic()
        if wait > 0:
            self._redraw = self.set_timer(wait, self._redraw_now)
        else:
            await self._show()

    async def _redraw_now(self) -> None:
        self._redraw = None
        if self._in_view():  # the tab may have gone to the background since the timer was set
            await self._show()

    def _in_view(self) -> bool:
        return self.display and self.is_on_screen

    def on_show(self) -> None:
        if self._reply is not None:  # a background tab brought forward: catch up on the answer and thinking
            self.call_later(self._show)

    async def on_reply_finished(self, message: ReplyFinished) -> None:
        if self._redraw is not None:
            self._redraw.stop()
            self._redraw = None
        self._text = message.text
        if message.turn is not None:
            self._reasoning = message.turn.get("reasoning") or ""
        await self._show()
        if self._reply is not None:
            self._reply.end_stream()
        conversation = self.query_one("#conversation")
        if message.error:  # the engine refused the turn: neither it nor a reply is shown; its text is kept
            if self._reply is not None:
                await self._reply.remove()
            await self.drop_last_turns(1)
            await conversation.mount(Static(f"error: {message.error}", classes="note", markup=False))
            if message.refused_text is not None and not self.query_one(PromptInput).text:
                self.set_prompt(message.refused_text)
            self.set_attachments(message.refused_images + self.attachments)
        elif message.turn is not None:
            await conversation.mount_all(self._footer(message.turn))
        self._reply = None

    async def _show(self) -> None:
        """Append the text not yet shown; Markdown.append re-parses only from the last block on."""
        self._last_shown = time.monotonic()
        if self._reply is not None:
            await self._show_thinking()
        if self._reply is not None and len(self._text) > self._num_shown:
            new = printable(self._text[self._num_shown:])
            self._num_shown = len(self._text)
            self.num_redraws += 1
            await self._reply.append(new)
            self._reply.keep_room_in_last_block()

    async def _show_thinking(self) -> None:
        """The thinking so far, in its own fold above the answer; folded as soon as the answer starts."""
        if self._reasoning and self._thinking is None:
            self._thinking = self._thinking_widget(self._reasoning, collapsed=False)
            await self.query_one("#conversation").mount(self._thinking, before=self._reply)
        elif self._thinking is not None:
            self._thinking.query_one(".thinking-text", Static).update(printable(self._reasoning))
        if self._thinking is not None and self._text and not self._thinking.collapsed:
            self._thinking.collapsed, self._thinking.title = True, "Thought"
