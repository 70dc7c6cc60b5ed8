"""ChatScreen: the sessions and the engine panel. It owns the sessions, their reply streams and the
stats polling; widgets only display what it posts to them."""

from __future__ import annotations

import asyncio
import re
import time
import uuid

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.markup import escape
from textual.screen import Screen
from textual.widgets import Footer, TabbedContent, TabPane
from textual.worker import Worker

from tinymlx.core.outputs import RequestMetrics
from tinymlx.engine.async_engine import AsyncEngine
from tinymlx.turns.reply_format import PLAIN
from tinymlx_ui.compositor import RowCompositor
from tinymlx_ui.messages import EngineSnapshot, ReplyFinished, ReplyUpdated, SendRequested
from tinymlx_ui.monitor import EngineMonitor, PanelData
from tinymlx_ui.reply_parts import ReplyParts
from tinymlx_ui.screens.chat_images import ImageAttaching
from tinymlx_ui.screens.sessions import SessionsScreen
from tinymlx_ui.screens.settings import SettingsScreen
from tinymlx_ui.session import NEW_TITLE, ChatSession, SessionSettings, title_from
from tinymlx_ui.store import HistoryStore, data_dir
from tinymlx_ui.transcript import reply_stats, session_markdown
from tinymlx_ui.widgets.colors import session_color
from tinymlx_ui.widgets.engine_panel import EnginePanel
from tinymlx_ui.widgets.session_view import SessionView
from tinymlx_ui.widgets.status_bar import EngineInfo, StatusBar

POLL_INTERVAL_S = 0.2  # engine stats are sampled this often (the graphs' resolution)
PANEL_REDRAW_S = 2.0  # and drawn at most this often: a redraw takes UI-thread time the step loop needs


class ChatScreen(ImageAttaching, Screen):
    # Keys that reach the app in tmux, macOS Terminal, iTerm2, kitty and VS Code: Ctrl+Tab usually does
    # not (the terminal keeps it), so Ctrl+PgUp / Ctrl+PgDn switch sessions; none of these is a
    # TextArea key the prompt needs, except Ctrl+W (delete word), which the footer names.
    BINDINGS = [
        # Priority: the focused TextArea binds Ctrl+W (delete word) itself.
        Binding("ctrl+n", "new_session", "New", tooltip="New session", priority=True),
        Binding("ctrl+w", "close_session", "Close", tooltip="Close the session (its history is kept)",
                priority=True),
        # The footer shows an action's last binding: the keys it should name come after the hidden ones.
        Binding("ctrl+tab", "next_session", "Next", tooltip="Next session (where the terminal passes it on)",
                show=False),
        Binding("ctrl+shift+tab", "previous_session", "Prev", tooltip="Previous session", show=False),
        # Priority: scrollable containers bind Ctrl+PgUp/PgDn (page left/right) and would take them first.
        Binding("ctrl+pagedown", "next_session", "Next", tooltip="Next session", priority=True),
        Binding("ctrl+pageup", "previous_session", "Prev", tooltip="Previous session", priority=True),
        Binding("escape", "cancel_reply", "Cancel", tooltip="Cancel the reply (frees its KV blocks)"),
        Binding("ctrl+r", "regenerate", "Retry", tooltip="Regenerate the last reply (the conversation's KV "
                "blocks come back from the prefix cache)", priority=True),
        Binding("ctrl+l", "edit_last", "Edit", tooltip="Edit and resend your last message", priority=True),
        Binding("ctrl+g", "copy_reply", "Copy", tooltip="Copy the last reply to the clipboard", priority=True),
        Binding("ctrl+b", "copy_code", "Copy code", tooltip="Copy the last reply's last code block",
                priority=True, show=False),
        Binding("ctrl+s", "export", "Export", tooltip="Export the session as Markdown", priority=True,
                show=False),
        Binding("ctrl+f", "attach_image", "Image", tooltip="Attach an image file (or drag one into the terminal)",
                priority=True, show=False),
        Binding("f2", "settings", "Settings", tooltip="System prompt, sampling and JSON output of the session"),
        Binding("ctrl+o", "open_session", "Sessions", tooltip="Reopen a saved session", show=False),
        Binding("ctrl+t", "app.pick_model", "Model", tooltip="Switch the model (the engine reloads; sessions keep "
                "their history)", priority=True, show=False),
        Binding("f3", "toggle_panel", "Panel", tooltip="Show or hide the engine panel", show=False),
        Binding("f4", "toggle_block_map", "Block map", tooltip="Block map: the blocks in use and cached, or the "
                "whole pool", show=False),
    ]

    def __init__(self, engine: AsyncEngine, store: HistoryStore, info: EngineInfo, defaults: SessionSettings):
        super().__init__()
        self._compositor = RowCompositor()  # a frame renders only the rows it changes (see ui/compositor.py)
        self._engine, self._store, self._info, self._defaults = engine, store, info, defaults
        self._views: dict[int, SessionView] = {}  # open sessions, in tab order
        self._replies: dict[int, Worker] = {}  # session -> its reply stream in flight
        self._cancelled: set[int] = set()  # sessions whose reply the user cancelled (vs. cut off by quitting)
        self._monitor = EngineMonitor()
        self._last_data: PanelData | None = None  # the newest sample
        self._drawn_data: PanelData | None = None  # the one last sent to the panel
        self._drawn_at = float("-inf")

    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            yield TabbedContent(id="chats")
            yield EnginePanel(id="panel")
        yield StatusBar(self._info, id="status")
        yield Footer(compact=True)

    async def on_mount(self) -> None:
        for session_id in self._store.open_session_ids():
            await self._open(self._store.load(session_id))
        if not self._views:
            await self.action_new_session()
        self.set_interval(POLL_INTERVAL_S, self._poll)

    # -- sessions -----------------------------------------------------------------------------
    @property
    def active_view(self) -> SessionView | None:
        return self._view_of_pane(self.query_one(TabbedContent).active)

    def _view_of_pane(self, pane_id: str | None) -> SessionView | None:
        session_id = (pane_id or "").removeprefix("session-")
        return self._views.get(int(session_id)) if session_id.isdigit() else None

    async def _open(self, session: ChatSession) -> None:
        self._measure_stored_images(session)
        view = SessionView(session, sees_images=self._sees_images)
        self._views[session.session_id] = view
        await self.query_one(TabbedContent).add_pane(
            TabPane(self._label(session), view, id=f"session-{session.session_id}")
        )
        self._activate(session.session_id)

    def _activate(self, session_id: int) -> None:
        # Focus first. An input that still has focus as its pane hides hands focus to a sibling in
        # that hidden pane, which re-activates it: two tabs would keep activating each other.
        self._views[session_id].focus_input()
        self.query_one(TabbedContent).active = f"session-{session_id}"

    @staticmethod
    def _label(session: ChatSession) -> str:
        return f"[{session_color(session.session_id)}]●[/] {escape(session.title)}"

    async def action_new_session(self) -> None:
        await self._open(self._store.create_session(self._defaults))

    async def action_close_session(self) -> None:
        view = self.active_view
        if view is None:
            return
        session_id = view.session.session_id
        if session_id in self._replies:
            self._replies[session_id].cancel()
        self._store.set_open(session_id, False)
        del self._views[session_id]
        await self.query_one(TabbedContent).remove_pane(f"session-{session_id}")
        if not self._views:
            await self.action_new_session()

    def _switch(self, step: int) -> None:
        ids = list(self._views)
        current = self.active_view
        if current is not None:
            self._activate(ids[(ids.index(current.session.session_id) + step) % len(ids)])

    def action_next_session(self) -> None:
        self._switch(1)

    def action_previous_session(self) -> None:
        self._switch(-1)

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        if event.pane.id != self.query_one(TabbedContent).active:
            return  # stale: queued before a later activation (the first pane added activates itself)
        view = self._view_of_pane(event.pane.id)  # a clicked tab: type into its session at once
        if view is not None and not view.has_focus_within:
            view.focus_input()

    def action_open_session(self) -> None:
        self.app.push_screen(SessionsScreen(self._store.summaries()), self._reopen)

    async def _reopen(self, session_id: int | None) -> None:
        if session_id is None:
            return
        if session_id in self._views:
            self._activate(session_id)
            return
        self._store.set_open(session_id, True)
        await self._open(self._store.load(session_id))

    def action_settings(self) -> None:
        view = self.active_view
        if view is not None:
            session = view.session

            disk = self._engine.stats().disk_cache
            screen = SettingsScreen(session.settings, session.title, None if disk is None else disk.is_enabled)

            def apply(settings: SessionSettings | None) -> None:
                if settings is not None:
                    session.settings = settings
                    self._store.save_session(session)
                    view.show_settings()
                    if disk is not None and screen.disk_cache != disk.is_enabled:
                        self._engine.set_disk_cache(screen.disk_cache)

            self.app.push_screen(screen, apply)

    def action_toggle_block_map(self) -> None:
        self.query_one(EnginePanel).toggle_block_map_zoom()

    def action_toggle_panel(self) -> None:
        panel = self.query_one(EnginePanel)
        panel.display = not panel.display
        if panel.display:
            self._draw_panel(time.monotonic())

    # -- replies ------------------------------------------------------------------------------
    def on_send_requested(self, message: SendRequested) -> None:
        view = self._views[message.session_id]
        session = view.session
        turn = {"role": "user", "content": message.text}
        if message.images:
            turn["images"] = message.images
        session.turns.append(turn)
        if session.title == NEW_TITLE:
            session.title = title_from(message.text or message.images[0].name)
            self._store.save_session(session)
            self.query_one(TabbedContent).get_tab(f"session-{session.session_id}").label = self._label(session)
        self._start_reply(session, view, user_turn_saved=False)

    def _start_reply(self, session: ChatSession, view: SessionView, user_turn_saved: bool) -> None:
        self._cancelled.discard(session.session_id)
        self._replies[session.session_id] = self.run_worker(self._stream_reply(session, view, user_turn_saved),
                                                            group="replies")

    def action_cancel_reply(self) -> None:
        view = self.active_view
        if view is not None and view.session.session_id in self._replies:
            self._cancelled.add(view.session.session_id)
            self._replies[view.session.session_id].cancel()  # leaving the stream aborts the request

    def _idle_view(self) -> SessionView | None:
        """The active session if it is not replying (else a notice and None)."""
        view = self.active_view
        return None if view is None or view.refuse_if_replying() else view

    async def action_regenerate(self) -> None:
        view = self._idle_view()
        if view is None or not view.session.turns or view.session.turns[-1]["role"] != "assistant":
            return
        session = view.session
        session.turns.pop()
        self._store.delete_last_turns(session.session_id, 1)
        await view.begin_reply(None, num_dropped_turns=1)  # not dropped first: that await let a send slip in
        self._start_reply(session, view, user_turn_saved=True)

    async def action_edit_last(self) -> None:
        """The last user message goes back into the prompt; it and what followed leave the session."""
        view = self._idle_view()
        session = view.session if view is not None else None
        users = [i for i, turn in enumerate(session.turns) if turn["role"] == "user"] if session else []
        if not users:
            return
        dropped = len(session.turns) - users[-1]
        text, images = session.turns[users[-1]]["content"], session.turns[users[-1]].get("images", ())
        del session.turns[users[-1]:]
        self._store.delete_last_turns(session.session_id, dropped)
        await view.drop_last_turns(dropped)
        view.set_prompt(text)
        view.set_attachments(images)

    def _last_reply(self) -> str | None:
        view = self.active_view
        replies = [t["content"] for t in view.session.turns if t["role"] == "assistant"] if view else []
        return replies[-1] if replies else None

    def action_copy_reply(self) -> None:
        reply = self._last_reply()
        if reply is None:
            self.notify("No reply to copy yet.", severity="warning")
            return
        self.app.copy_to_clipboard(reply)  # OSC 52: works over ssh and in tmux with set-clipboard on
        self.notify(f"Copied the last reply ({len(reply)} characters).")

    def action_copy_code(self) -> None:
        blocks = re.findall(r"```[^\n]*\n(.*?)```", self._last_reply() or "", flags=re.DOTALL)
        if not blocks:
            self.notify("The last reply has no code block.", severity="warning")
            return
        self.app.copy_to_clipboard(blocks[-1])
        self.notify(f"Copied the last code block ({len(blocks[-1].splitlines())} lines).")

    def action_export(self) -> None:
        view = self.active_view
        if view is None:
            return
        session = view.session
        slug = re.sub(r"[^a-z0-9]+", "-", session.title.lower()).strip("-") or "chat"
        path = data_dir() / "exports" / f"session-{session.session_id}-{slug}.md"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(session_markdown(session))
        self.notify(f"Exported to {path}")

    async def _stream_reply(self, session: ChatSession, view: SessionView, user_turn_saved: bool) -> None:
        reason, metrics, error = None, None, None
        prompt = session.prompt(chat=self._info.has_chat_template)
        reply_format = PLAIN if isinstance(prompt, str) else self._info.reply_format  # a base model's text: all answer
        # Only the prompt's end matters here (does it open a think block): rendered without the images' bytes.
        prompt_text = (self._engine.engine.tokenizer.render_chat(session.prompt_messages(with_images=False))
                       if reply_format.thinks else "")
        parts = ReplyParts(reply_format, prompt_text)
        try:
            params = reply_format.reading(session.settings.sampling_params())
            request_id = session.request_id(uuid.uuid4().hex[:8])
            async for output in self._engine.generate(prompt, params, request_id=request_id):
                parts.feed(output.delta_text)
                reason, metrics = output.finish_reason, output.metrics
                view.post_message(ReplyUpdated(session.session_id, parts.answer, parts.reasoning))
        except asyncio.CancelledError:
            reason = "abort"
            raise
        except Exception as exc:  # noqa: BLE001 - a refused request (too long, engine down) ends only this reply
            error = str(exc) or type(exc).__name__
        finally:
            parts.finish()
            self._finish(session, view, parts, reason, metrics, error, user_turn_saved)

    def _finish(self, session: ChatSession, view: SessionView, parts: ReplyParts, reason: str | None,
                metrics: RequestMetrics | None, error: str | None, user_turn_saved: bool) -> None:
        self._replies.pop(session.session_id, None)
        turn, refused_text, refused_images, text = None, None, (), parts.answer
        if error is None:
            turn = {"role": "assistant", "content": text, "note": self._note(session.session_id, reason),
                    "stats": reply_stats(metrics)}
            if parts.reasoning:
                turn["reasoning"] = parts.reasoning
            self._store.add_turns(session.session_id, [turn] if user_turn_saved else [session.turns[-1], turn])
            session.turns.append(turn)
            if metrics is not None:
                self._monitor.record_reply(session.session_id, metrics.ttft_s, metrics.tokens_per_s)
        else:  # the engine refused this turn: it did not happen, and its text goes back to the prompt
            refused = session.turns.pop()
            refused_text, refused_images = refused["content"], refused.get("images", ())
            if user_turn_saved:
                self._store.delete_last_turns(session.session_id, 1)
        view.post_message(ReplyFinished(session.session_id, text, turn, error, refused_text, refused_images))

    def _note(self, session_id: int, reason: str | None) -> str | None:
        if reason == "abort":
            return "(cut off: cancelled)" if session_id in self._cancelled else "(cut off: the app quit)"
        return "(stopped at max tokens)" if reason == "length" else None

    # -- engine panel -------------------------------------------------------------------------
    def _poll(self) -> None:
        """Sample every poll (the graphs keep their resolution); draw only what changed, at most every
        PANEL_REDRAW_S, and nothing while the panel is hidden (it is drawn when shown again)."""
        now = time.monotonic()
        sessions = [(session_id, view.session.title) for session_id, view in self._views.items()]
        stats = self._engine.stats()
        self._last_data = self._monitor.sample(stats, now, sessions)
        if not self.query_one(EnginePanel).display:  # nothing beside it to agree with: every sample
            self.query_one(StatusBar).show_stats(stats)  # a no-op unless its line changes
        elif now - self._drawn_at >= PANEL_REDRAW_S:
            self._draw_panel(now)

    def _draw_panel(self, now: float) -> None:
        panel = self.query_one(EnginePanel)
        if panel.display and self._last_data is not None and self._last_data != self._drawn_data:
            self._drawn_data, self._drawn_at = self._last_data, now
            panel.post_message(EngineSnapshot(self._last_data))
            # The status bar shows the same sample, so the figures the two repeat agree at every moment.
            self.query_one(StatusBar).show_stats(self._last_data.stats)

