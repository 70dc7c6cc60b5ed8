"""The UI's redraws stay bounded while replies stream: the UI thread shares the CPU and the GIL with the
engine's step loop, so every redraw it skips is decode speed kept (benchmarks/chat_overhead.py measures it).
These count work, not time."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from test_ui_app import SIZE, make_app, send, started, submit, wait_for
from test_ui_snapshots import panel_data
from textual._compositor import Compositor
from textual.app import App, ComposeResult
from textual.geometry import Region
from textual.widget import Widget
from textual.widgets import Label, Markdown
from textual.widgets._markdown import MarkdownBullet, MarkdownOrderedList  # not exported

from tinymlx_ui.messages import EngineSnapshot, ReplyFinished, ReplyUpdated
from tinymlx_ui.screens.chat import PANEL_REDRAW_S
from tinymlx_ui.session import ChatSession
from tinymlx_ui.widgets import session_view
from tinymlx_ui.widgets.engine_panel import EnginePanel
from tinymlx_ui.widgets.reply_markdown import SPARE_ROWS
from tinymlx_ui.widgets.session_view import REPLY_INTERVAL_S, SessionView, printable

pytestmark = pytest.mark.asyncio


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_DATA", str(tmp_path / "data"))


@pytest.fixture
def appends(monkeypatch) -> list[str]:
    """Every fragment written into a Markdown widget (the streaming reply's redraws)."""
    written: list[str] = []
    append = Markdown.append

    def counted(self, markdown: str):
        written.append(markdown)
        return append(self, markdown)

    monkeypatch.setattr(Markdown, "append", counted)
    return written


class ViewHost(App):
    def compose(self) -> ComposeResult:
        yield SessionView(ChatSession(1))


async def test_a_reply_redraws_at_most_once_an_interval_however_many_tokens_arrive(appends):
    async with ViewHost().run_test(size=SIZE) as pilot:
        view = pilot.app.query_one(SessionView)
        await view.begin_reply("hi")
        text, start = "", time.monotonic()
        for i in range(300):  # one token an event-loop turn: faster than any engine, but not all at once
            text += f"w{i} "
            view.post_message(ReplyUpdated(1, text))
            await pilot.pause(0)
        elapsed = time.monotonic() - start
        view.post_message(ReplyFinished(1, text, {"role": "assistant", "content": text}))
        await wait_for(pilot, lambda: not view.is_replying, what="the reply to finish")
        assert len(appends) <= elapsed / REPLY_INTERVAL_S + 2, f"{len(appends)} redraws in {elapsed:.2f} s"
        assert "".join(appends) == text  # each redraw appended only the new text
        assert view.query_one(".turn.assistant", Markdown).source == text


async def test_the_panel_redraws_at_most_once_an_interval_and_not_while_hidden(monkeypatch):
    shown: list[float] = []
    show = EnginePanel.show

    def counted(self, data):
        shown.append(time.monotonic())
        return show(self, data)

    monkeypatch.setattr(EnginePanel, "show", counted)
    app = make_app(max_tokens=300, step_delay_s=0.01)  # a reply of a few panel intervals
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        shown.clear()
        start = time.monotonic()
        submit(pilot, "a long answer please")
        view = screen.active_view
        await wait_for(pilot, lambda: view.is_replying, what="the reply to start")
        await wait_for(pilot, lambda: not view.is_replying, what="the reply")
        await pilot.pause(2 * PANEL_REDRAW_S)  # the last change is drawn, however soon after a redraw it came
        elapsed = time.monotonic() - start
        assert 2 <= len(shown) <= elapsed / PANEL_REDRAW_S + 2, f"{len(shown)} redraws in {elapsed:.2f} s"

        screen.action_toggle_panel()  # hidden: no redraws while a reply streams
        shown.clear()
        submit(pilot, "another one")
        await wait_for(pilot, lambda: view.is_replying, what="the second reply to start")
        await wait_for(pilot, lambda: not view.is_replying, what="the second reply")
        await pilot.pause(2 * PANEL_REDRAW_S)
        assert shown == []
        screen.action_toggle_panel()  # shown again: drawn at once, with the newest data
        await pilot.pause(0.1)
        assert len(shown) == 1
        hits = f"prefix hits {app.async_engine.stats().prefix_hit_rate:.0%}"  # the second turn's, not the first's
        assert str(screen.query_one("#counters").render()).startswith(hits)


class PanelHost(App):
    def compose(self) -> ComposeResult:
        yield EnginePanel()


async def test_new_numbers_in_the_panel_do_not_relayout_the_screen(monkeypatch):
    """A relayout is a pass over every widget on the screen; new numbers in fixed-size widgets need none."""
    data = panel_data()
    async with PanelHost().run_test(size=SIZE) as pilot:
        panel = pilot.app.query_one(EnginePanel)
        panel.post_message(EngineSnapshot(data))
        await pilot.pause(0.1)
        relayouts: list[str] = []
        refresh = Widget.refresh

        def recorded(self, *regions, layout: bool = False, **kwargs):
            if layout:
                relayouts.append(type(self).__name__)
            return refresh(self, *regions, layout=layout, **kwargs)

        monkeypatch.setattr(Widget, "refresh", recorded)
        stats = replace(data.stats, num_steps=data.stats.num_steps + 1, num_batched_tokens=7, prefix_hit_rate=0.5)
        series = replace(data.series, tokens_per_s=data.series.tokens_per_s[1:] + (99.0,))
        panel.post_message(EngineSnapshot(replace(data, stats=stats, series=series, tokens_per_s=12.5)))
        await pilot.pause(0.1)
        assert relayouts == []
        assert panel.query_one("#tokens").render_line(0).text.startswith("tokens/step 7 ")


@pytest.mark.parametrize("kind", ["paragraph", "code"])
async def test_a_streaming_reply_relayouts_the_screen_only_when_it_grows(monkeypatch, kind):
    """Each redraw updates the reply's last block; only a new line (or a longer longest line of code)
    changes its size, so only those relayout. The reply still ends laid out to its full text."""
    monkeypatch.setattr(session_view, "REPLY_INTERVAL_S", 0.05)  # a redraw per word, without a 16 s test
    async with ViewHost().run_test(size=SIZE) as pilot:
        view = pilot.app.query_one(SessionView)
        await view.begin_reply("hi")
        reply = view.query_one(".turn.assistant", Markdown)
        relayouts: list[str] = []
        refresh = Widget.refresh

        def recorded(self, *regions, layout: bool = False, **kwargs):
            if layout and (self is reply or reply in self.ancestors):
                relayouts.append(type(self).__name__)
            return refresh(self, *regions, layout=layout, **kwargs)

        monkeypatch.setattr(Widget, "refresh", recorded)
        text = "```python\n" if kind == "code" else ""
        words = [f"x{i} = {i}  # a line of code\n" if kind == "code" and i % 8 == 7 else "word " for i in range(64)]
        for word in words:
            text += word
            view.post_message(ReplyUpdated(1, text))
            await pilot.pause(0.05)
        block = reply.children[-1]
        content = block.query_one(Label) if kind == "code" else block
        num_lines = content.size.height
        assert num_lines >= 3
        # A paragraph: about one a new line. Code: also while its first line (the longest) grows, and a few
        # (the fence, the document, the label) for each new line; before, every redraw relayouted.
        bound = 2 * num_lines + 4 if kind == "paragraph" else len(words) * 3 // 4
        assert len(relayouts) <= bound, f"{len(relayouts)} relayouts for {len(words)} redraws: {relayouts}"
        # Laid out to its whole text: the height layout gives it holds all of it, and a few spare rows at most.
        needed = content.get_content_height(content.size, content.size, content.content_size.width)
        assert needed <= content.size.height <= needed + SPARE_ROWS
        assert reply.source == text


@pytest.mark.parametrize("kind", ["paragraph", "code"])
async def test_a_streaming_reply_grows_into_spare_rows_without_a_relayout(monkeypatch, kind):
    """While a reply streams, the block it grows in keeps SPARE_ROWS blank rows below its text: the new
    lines that land in them need no relayout (nor the scroll after one), so one relayout serves several
    lines. A long line of code is cut at the block's width until then. At the end the rows go."""
    monkeypatch.setattr(session_view, "REPLY_INTERVAL_S", 0.02)
    async with ViewHost().run_test(size=SIZE) as pilot:
        view = pilot.app.query_one(SessionView)
        await view.begin_reply("hi")
        reply = view.query_one(".turn.assistant", Markdown)
        text = ("```python\n" if kind == "code" else "") + "first"
        view.post_message(ReplyUpdated(1, text))
        await pilot.pause(0.1)
        reflows: list[int] = []
        reflow = Compositor.reflow
        monkeypatch.setattr(Compositor, "reflow", lambda *args: reflows.append(1) or reflow(*args))
        words = [f"x{i} = {i}  # {'a long comment ' * (i % 3 * 4)}\n" for i in range(30)] if kind == "code" else \
            ["word "] * 240
        for word in words:
            text += word
            view.post_message(ReplyUpdated(1, text))
            await pilot.pause(0.03)
        block = reply.children[-1]
        content = block.query_one(Label) if kind == "code" else block
        needed = content.get_content_height(content.size, content.size, content.content_size.width)
        assert needed >= 8 and needed <= content.size.height <= needed + SPARE_ROWS
        assert content.styles.inline.has_rule("min_height"), "no spare rows below a streaming reply"
        # Before: a relayout a line. A relayout is two passes (the second for the sizes the first changed).
        assert len(reflows) <= 2 * (needed / (SPARE_ROWS + 1) + 2), f"{len(reflows)} passes for {needed} lines"
        view.post_message(ReplyFinished(1, text, {"role": "assistant", "content": text}))
        await wait_for(pilot, lambda: not view.is_replying, what="the reply to finish")
        await pilot.pause(0.1)
        assert content.size.height == needed and not content.styles.inline.has_rule("min_height")  # rows gone
        if kind == "code":  # as wide as its longest line again
            assert content.content_size.width == max(len(line) for line in text.splitlines()[1:])
        assert reply.source == text


async def test_a_streaming_list_grows_in_place(monkeypatch):
    """Textual remounts a whole list at each update of it (new widgets and a relayout each redraw); a
    reply's list keeps its rows, updates its last item and mounts new ones after it, and ends as the
    list of its whole text would be. Bullets that widen (9 -> 10 items) renumber it: one remount."""
    monkeypatch.setattr(session_view, "REPLY_INTERVAL_S", 0.02)
    async with ViewHost().run_test(size=SIZE) as pilot:
        view = pilot.app.query_one(SessionView)
        await view.begin_reply("hi")
        reply = view.query_one(".turn.assistant", Markdown)
        text, lists = "Steps:\n\n", set()
        for n in range(1, 12):
            for word in [f"{n}. **Step {n}**:", *["word"] * 12, "\n   - a nested point\n" if n == 3 else "\n"]:
                text += word + ("" if word.endswith("\n") else " ")
                view.post_message(ReplyUpdated(1, text))
                await pilot.pause(0.03)
                lists.update(reply.query(MarkdownOrderedList))
        assert len(lists) <= 2, f"the list was mounted {len(lists)} times"
        view.post_message(ReplyFinished(1, text, {"role": "assistant", "content": text}))
        await wait_for(pilot, lambda: not view.is_replying, what="the reply to finish")
        whole = Markdown(text)
        await view.mount(whole)
        await pilot.pause(0.1)

        def shown(markdown: Markdown) -> list[tuple[str, str]]:
            return [w.symbol if isinstance(w, MarkdownBullet) else w._content.plain
                    for w in markdown.query("MarkdownBullet, MarkdownParagraph")]

        assert shown(reply) == shown(whole) and len(reply.query(MarkdownBullet)) == 11 + 1


async def test_a_reply_in_a_background_tab_draws_nothing_until_shown(appends):
    app = make_app(max_tokens=300, step_delay_s=0.01)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        submit(pilot, "first question")
        first = screen.active_view
        await wait_for(pilot, lambda: first.is_replying, what="the reply to start")
        await screen.action_new_session()  # the first session goes to a background tab
        await pilot.pause(0.05)
        drawn = len(appends)
        received = len(first._text)
        await wait_for(pilot, lambda: len(first._text) > received + 20, what="more tokens")
        assert len(appends) == drawn, "a reply in a background tab redrew"
        assert first.is_replying
        screen.action_previous_session()  # brought to the front mid-reply: it catches up at once
        await wait_for(pilot, lambda: len(first._reply.source) >= received + 20, timeout=2, what="the catch-up")
        await wait_for(pilot, lambda: not first.is_replying, what="the reply")
        assert first.query(".turn.assistant").last(Markdown).source == printable(first.session.turns[-1]["content"])


@pytest.fixture
def frames(monkeypatch) -> list[dict]:
    """Each partial update the compositor renders: its dirty regions and the widgets it rendered."""
    recorded: list[dict] = []
    current: list[dict | None] = [None]
    render_update, render_lines = Compositor.render_partial_update, Widget.render_lines

    def update(self):
        current[0] = {"dirty": list(self._dirty_regions), "rendered": []}
        recorded.append(current[0])
        try:
            return render_update(self)
        finally:
            current[0] = None

    def lines(self, crop):
        if current[0] is not None:
            current[0]["rendered"].append(self)
        return render_lines(self, crop)

    monkeypatch.setattr(Compositor, "render_partial_update", update)
    monkeypatch.setattr(Widget, "render_lines", lines)
    return recorded


async def test_a_streaming_reply_draws_a_few_frames_a_second_of_its_own_rows_only(frames):
    """Tokens every 10 ms: the screen draws at most one redraw a REPLY_INTERVAL_S, and a frame of the reply
    renders only the widgets on its rows, not the engine panel, the status bar or the footer (Textual's
    own compositor rendered every widget on the screen, all of its rows, for each frame)."""
    async with make_app().run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        view = screen.active_view
        await view.begin_reply("hi")
        await pilot.pause(0.3)
        frames.clear()
        text, start = "", time.monotonic()
        while time.monotonic() - start < 1.5:
            text += "word "
            view.post_message(ReplyUpdated(view.session.session_id, text))
            await asyncio.sleep(0.01)
        elapsed = time.monotonic() - start
        await pilot.pause(REPLY_INTERVAL_S)
        conversation = view.query_one("#conversation").region
        reply_frames = [f for f in frames if f["dirty"] and all(conversation.contains_region(r) for r in f["dirty"])]
        assert reply_frames, "the reply drew nothing"
        # A redraw that adds a line is two frames: the relayout's, then the scroll keeping the reply in view.
        assert len(frames) <= 2 * (elapsed / REPLY_INTERVAL_S + 1) + 1, f"{len(frames)} frames in {elapsed:.2f} s"
        aside = [screen.query_one(EnginePanel), screen.query_one("#status"), screen.query_one("Footer")]
        for frame in reply_frames:
            drawn = [w for w in frame["rendered"] if any(w is a or a in w.ancestors for a in aside)]
            assert drawn == [], f"a frame of the reply rendered {sorted({type(w).__name__ for w in drawn})}"


async def test_a_frame_of_a_few_rows_writes_the_cells_a_full_render_has():
    """RowCompositor renders only the rows a frame changes: every cell it writes is the cell a full
    render of the screen has there (the main screen: two sessions, a reply with code, the panel)."""
    async with make_app().run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        await send(pilot, "hello")
        await screen.action_new_session()
        await send(pilot, "a second question")
        await wait_for(pilot, lambda: screen.query_one(EnginePanel).num_shown, what="the panel's first snapshot")
        await pilot.pause(0.2)
        compositor = screen._compositor
        width, height = compositor.size
        full = compositor._render_chops(compositor.size.region, lambda y: True)
        crops = [Region(3, 20, 60, 3), Region(80, 1, 30, 2), Region(0, height - 2, width, 2), Region(10, 5, 100, 30),
                 Region(0, 0, 1, 1), Region(width - 1, height - 1, 1, 1)]
        for crop in crops:
            chops = compositor._render_chops(crop, lambda y: True)
            for y in crop.line_range:
                ends = compositor.cuts[y][1:]
                for (x, strip), end in zip(chops[y].items(), ends):
                    if x < crop.right and end > crop.x:  # a chop the frame writes
                        assert strip is not None and list(strip) == list(full[y][x]), f"{crop}: line {y}, x {x}"


async def test_a_frame_of_the_engine_panel_renders_a_dozen_widgets(frames):
    """The panel redraws each second while replies stream: each graph row is one widget drawn line by line
    (as a container of two labels and a sparkline it was four), so its frame renders about 12 widgets, not 30."""
    async with make_app().run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        panel = screen.query_one(EnginePanel)
        await wait_for(pilot, lambda: panel.num_shown, what="the panel's first snapshot")
        await pilot.pause(0.2)
        frames.clear()
        panel.post_message(EngineSnapshot(panel_data()))  # every graph, caption and count changes
        await pilot.pause(0.2)
        drawn = {w for frame in frames for w in frame["rendered"] if w is panel or panel in w.ancestors}
        assert len(drawn) >= 10, f"the panel's frame rendered only {sorted(type(w).__name__ for w in drawn)}"
        assert len(drawn) <= 12, f"{len(drawn)} widgets: {sorted(type(w).__name__ for w in drawn)}"
