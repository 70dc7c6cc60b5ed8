"""The UI's redraws stay bounded while replies stream: the UI thread shares the CPU and the GIL with the
engine's step loop, so every redraw it skips is decode speed kept (benchmarks/chat_overhead.py measures it).
These count work, not time."""

from __future__ import annotations

import asyncio
import gc
import random
import re
import time
from collections import Counter
from dataclasses import replace

import pytest
from rich.cells import cell_len
from rich.segment import ControlType
from test_ui_app import SIZE, make_app, send, started, submit, wait_for
from test_ui_snapshots import panel_data
from textual._compositor import Compositor
from textual.app import App, ComposeResult
from textual.containers import Horizontal
from textual.content import Content, Span, _FormattedLine
from textual.geometry import Region
from textual.strip import Strip
from textual.style import Style as ContentStyle
from textual.visual import Visual
from textual.widget import Widget
from textual.widgets import Label, Markdown, Static
from textual.widgets._markdown import MarkdownBlock, MarkdownBullet, MarkdownOrderedList  # not exported

from tinymlx_ui.messages import EngineSnapshot, ReplyFinished, ReplyUpdated
from tinymlx_ui.screens.chat import PANEL_REDRAW_S
from tinymlx_ui.session import ChatSession
from tinymlx_ui.widgets import session_view
from tinymlx_ui.widgets.block_map import BlockMap
from tinymlx_ui.widgets.engine_panel import EnginePanel
from tinymlx_ui.widgets.line_cache import CachedLines
from tinymlx_ui.widgets.prompt_input import PromptInput
from tinymlx_ui.widgets.reply_markdown import SPARE_ROWS, ReplyMarkdown
from tinymlx_ui.widgets.session_table import SessionTable
from tinymlx_ui.widgets.session_view import REPLY_INTERVAL_S, SessionView, printable

pytestmark = pytest.mark.asyncio


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_DATA", str(tmp_path / "data"))


@pytest.fixture
def appends(monkeypatch) -> list[str]:
    """Every fragment written into a reply's Markdown widget (the streaming reply's redraws)."""
    written: list[str] = []
    append = ReplyMarkdown.append

    def counted(self, markdown: str):
        written.append(markdown)
        return append(self, markdown)

    monkeypatch.setattr(ReplyMarkdown, "append", counted)
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
        whole = Markdown(text, classes="turn assistant")  # Textual's, beside it, as wide
        whole.styles.border_left = reply.styles.border_left
        await view.query_one("#conversation").mount(whole)
        await pilot.pause(0.1)

        def shown(markdown: Markdown) -> list[tuple[str, str]]:
            return [w.symbol if isinstance(w, MarkdownBullet) else w._content.plain
                    for w in markdown.query("MarkdownBullet, MarkdownParagraph")]

        assert shown(reply) == shown(whole) and len(reply.query(MarkdownBullet)) == 11 + 1
        # Laid out as Textual's list, with its CSS: each row as tall as its item (each was as tall as the screen).
        assert [row.size for row in reply.query(Horizontal)] == [row.size for row in whole.query(Horizontal)]
        assert reply.size == whole.size


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
        current[0] = {"dirty": list(self._dirty_regions), "rendered": [], "rows": []}
        recorded.append(current[0])
        try:
            return render_update(self)
        finally:
            current[0] = None

    def lines(self, crop):
        if current[0] is not None:
            current[0]["rendered"].append(self)
            current[0]["rows"].append((self, crop.height))
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


class ShadowTerminal:
    """The cells a terminal shows: each update the app writes, applied as a terminal applies it."""

    def __init__(self, monkeypatch) -> None:
        self.cells: dict[tuple[int, int], tuple[str, object]] = {}
        display = App._display

        def written(app, screen, renderable):
            if renderable is not None and not app._batch_count:  # what App._display sends
                self.write(app, renderable)
            return display(app, screen, renderable)

        monkeypatch.setattr(App, "_display", written)

    def write(self, app: App, update) -> None:
        x = y = 0
        for segment in update.__rich_console__(app.console, app.console.options):
            if segment.control:
                for code in segment.control:
                    if code[0] == ControlType.CURSOR_MOVE_TO:
                        x, y = code[1], code[2]
            elif segment.text == "\n":
                x, y = 0, y + 1
            else:
                for char in segment.text:
                    self.cells[x, y] = (char, segment.style)
                    x += cell_len(char)

    def differences(self, screen) -> list[str]:
        """The rows where the terminal differs from a full render of the screen now."""
        compositor = screen._compositor
        full = compositor._render_chops(compositor.size.region, lambda y: True)
        rows = []
        for y, chops in enumerate(full):
            x, want, have = 0, [], []
            for segment in Strip.join(chops.values()):
                for char in segment.text:
                    want.append((char, segment.style))
                    have.append(self.cells.get((x, y)))
                    x += cell_len(char)
            if want != have:
                rows.append(f"line {y}: {''.join(c[0] if c else '?' for c in have)!r}, "
                            f"not {''.join(c[0] for c in want)!r}")
        return rows


PARAGRAPH = ("A *paged KV cache* stores keys and values in **fixed-size blocks, so that sequences grow** "
             "without copying; see [the paper](https://example.com/paged) and `block_table[i]`: "
             + "supercalifragilisticexpialidocious" * 5 + " word" * 90
             + " *an emphasis that never closes and then does*").split(" ")
CODE = ["```python\n", "def merge(intervals):\n", '    """Merge', " overlapping\n", "    intervals.\n",
        '    """\n', "    out = []  # " + "a long comment " * 9 + "\n",
        *[f"    for start, end in sorted(intervals):  # step {i}\n" for i in range(12)], "    return out\n"]


STREAMED = {"paragraph": ["First paragraph.\n\n"] + ["word "] * 200,
            "list": ["A list:\n\n", "- one\n", "- two\n", "- three "] + ["word "] * 60,
            "code": ["Some code:\n\n", "```python\n"] + [f"x{i} = {i}\n" for i in range(14)]}
_EMPTY_QUOTE = re.compile(r"\s*[▌▍▎▏│┃>]\s*")  # a row that is only a quote bar (a left border) and blanks


def rows_below_the_text(screen, reply: Widget) -> list[str]:
    """The rows of `reply` shown below its last row of text, as a full render of the screen draws them."""
    compositor = screen._compositor
    full = compositor._render_chops(compositor.size.region, lambda y: True)
    region, clip = compositor.visible_widgets[reply]
    shown = region.intersection(clip)
    rows = [Strip.join(full[y].values()).text[shown.x:shown.right] for y in shown.line_range]
    last = max(y for y, row in enumerate(rows) if row.strip() and not _EMPTY_QUOTE.fullmatch(row))
    return rows[last + 1:]


async def replying_view(pilot):
    """The chat screen and its first session's view, replying to "hi" (no cursor blink to redraw meanwhile)."""
    screen = await started(pilot)
    view = screen.active_view
    view.query_one(PromptInput).cursor_blink = False
    await view.begin_reply("hi")
    return screen, view


@pytest.mark.parametrize("kind", ["paragraph", "list", "code"])
async def test_a_streaming_reply_shows_no_empty_quoted_lines_below_its_text(monkeypatch, kind):
    """#55: the reply's left border, its quote bar, ran down beside the spare rows below a streaming reply's
    text (8 empty quoted lines), and its last block's bottom margin added one more, there once it ended too.
    The bar stops at the last line of text, and the terminal shows what a full render has."""
    monkeypatch.setattr(session_view, "REPLY_INTERVAL_S", 0.02)
    terminal = ShadowTerminal(monkeypatch)
    async with make_app().run_test(size=SIZE) as pilot:
        screen, view = await replying_view(pilot)
        reply = view.query_one(".turn.assistant", ReplyMarkdown)
        text = ""
        for piece in STREAMED[kind]:
            text += piece
            view.post_message(ReplyUpdated(view.session.session_id, text))
            await pilot.pause(0.03)
        await pilot.pause(0.1)
        assert any(w.styles.inline.has_rule("min_height") for w in reply.query("*")), "no spare rows mid-stream"
        below = rows_below_the_text(screen, reply)
        assert below, "the spare rows are not in view"
        assert not any(_EMPTY_QUOTE.fullmatch(row) for row in below), "\n".join(below)
        assert terminal.differences(screen) == []
        view.post_message(ReplyFinished(view.session.session_id, text, {"role": "assistant", "content": text}))
        await wait_for(pilot, lambda: not view.is_replying, what="the reply to finish")
        await pilot.pause(0.1)
        below = rows_below_the_text(screen, reply)
        # Code ends with its box's bottom padding (the box's background); a paragraph or a list with its text.
        assert below == ([] if kind != "code" else below[:1]), "\n".join(below)
        assert terminal.differences(screen) == []


@pytest.mark.parametrize("kind", ["paragraph", "code"])
async def test_a_growing_block_renders_and_repaints_only_its_changed_rows(monkeypatch, frames, kind):
    """Each redraw of a growing paragraph or code block renders only the rows whose text changed (Textual
    rendered all of its rows, then repainted them all), and after each one the terminal shows the cells a
    full render of the screen has: styles that close later (emphasis, a docstring), a link, a folded
    word, code wider than its block, a narrower terminal."""
    monkeypatch.setattr(session_view, "REPLY_INTERVAL_S", 0)  # each update is one redraw
    terminal = ShadowTerminal(monkeypatch)
    rendered: list[int] = []
    to_strip = _FormattedLine.to_strip
    monkeypatch.setattr(_FormattedLine, "to_strip", lambda self, style: rendered.append(1) or to_strip(self, style))
    async with make_app().run_test(size=SIZE) as pilot:
        screen, view = await replying_view(pilot)
        reply = view.query_one(".turn.assistant", Markdown)
        await pilot.pause()
        pieces, text = PARAGRAPH if kind == "paragraph" else CODE, ""
        frames.clear()
        rendered.clear()
        reflows: list[int] = []
        reflow = Compositor.reflow
        monkeypatch.setattr(Compositor, "reflow", lambda *args: reflows.append(1) or reflow(*args))
        for index, piece in enumerate(pieces):
            if index == len(pieces) // 2:  # the rows wrap at another width: all of them render again
                await pilot.resize_terminal(SIZE[0] - 7, SIZE[1])
            text += piece if kind == "code" else piece + " "
            view.post_message(ReplyUpdated(view.session.session_id, text))
            await pilot.pause()
            assert terminal.differences(screen) == [], f"after {text!r}"
        block = reply.children[-1]
        content = block.query_one(Label) if kind == "code" else block
        num_rows = content.get_content_height(content.size, content.size, content.size.width)
        assert num_rows >= 12 and view.num_redraws == len(pieces)
        # Each redraw renders its new rows and those whose styles changed (emphasis closed, the docstring
        # ended), not every row: Textual's render was about num_rows / 2 a redraw on average.
        assert len(rendered) <= 2 * len(pieces) + 2 * num_rows, f"{len(rendered)} rows for {len(pieces)} redraws"
        # A frame paints its new rows; only a relayout's frames (its own and the scroll's after it: one for
        # each of its two passes) paint the whole block. Textual's repainted every row of it in every frame.
        painted = [rows for frame in frames for widget, rows in frame["rows"] if widget is content]
        big = [rows for rows in painted if rows > 2]
        assert painted and len(big) <= len(reflows) + 2, f"{len(reflows)} reflows; rows a frame: {painted}"
        assert reply.source == text


async def test_a_panel_frame_renders_only_the_rows_of_the_block_map_and_session_table_that_changed(frames,
                                                                                                  monkeypatch):
    """The panel redraws each second: the block map and the session table are drawn line by line, so a new
    rate in one session's row renders that row, and one more block its row of cells and the caption (both
    rendered all their rows for any change), and the terminal then shows what a full render has."""
    terminal = ShadowTerminal(monkeypatch)
    async with make_app().run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        panel = screen.query_one(EnginePanel)
        await wait_for(pilot, lambda: panel.num_shown, what="the panel's first snapshot")
        data = panel_data()
        panel.post_message(EngineSnapshot(data))
        await pilot.pause(0.2)
        block_map = screen.query_one(BlockMap)
        assert block_map.size.height >= 8

        frames.clear()
        data = replace(data, sessions=(replace(data.sessions[0], tokens_per_s=12.5), *data.sessions[1:]))
        panel.post_message(EngineSnapshot(data))
        await pilot.pause(0.2)
        rendered = Counter()
        for frame in frames:
            rendered.update({type(w).__name__: n for w, n in frame["rows"] if isinstance(w, (BlockMap, SessionTable))})
        assert rendered == {"SessionTable": 1}
        assert terminal.differences(screen) == []

        frames.clear()
        owners = {**data.block_map.owners, max(data.block_map.owners) + 1: (1,)}  # after the last: no cell moves
        panel.post_message(EngineSnapshot(replace(data, block_map=replace(data.block_map, owners=owners))))
        await pilot.pause(0.2)
        rendered = Counter()
        for frame in frames:
            rendered.update({type(w).__name__: n for w, n in frame["rows"] if isinstance(w, (BlockMap, SessionTable))})
        assert rendered == {"BlockMap": 2}  # its last row of cells, and the caption's counts
        assert terminal.differences(screen) == []


async def test_a_frame_of_a_reply_word_and_the_panel_renders_only_their_own_rows(frames, monkeypatch):
    """A reply's new word and the panel's numbers in one frame: each widget renders its rows inside the
    regions that changed, not every row of the box around both (all the rows between the reply's line and
    the session table's, across the screen), and the terminal then shows what a full render has."""
    monkeypatch.setattr(session_view, "REPLY_INTERVAL_S", 0)
    terminal = ShadowTerminal(monkeypatch)
    async with make_app().run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        panel, view = screen.query_one(EnginePanel), screen.active_view
        await wait_for(pilot, lambda: panel.num_shown, what="the panel's first snapshot")
        data = panel_data()
        panel.post_message(EngineSnapshot(data))
        await view.begin_reply("hi")
        view.post_message(ReplyUpdated(view.session.session_id, "A reply"))
        await pilot.pause(0.2)
        frames.clear()
        data = replace(data, sessions=(replace(data.sessions[0], tokens_per_s=12.5), *data.sessions[1:]))
        with pilot.app.batch_update():  # both handled before the next frame
            panel.post_message(EngineSnapshot(data))
            view.post_message(ReplyUpdated(view.session.session_id, "A reply grows"))
            await pilot.pause()
        await pilot.pause()
        both = [f for f in frames if len({r.x < panel.region.x for r in f["dirty"]}) == 2]
        assert both, "the reply and the panel were drawn in separate frames"
        rendered = Counter()
        for widget, rows in both[0]["rows"]:
            rendered[type(widget).__name__] += rows
        reply, table = view.query_one(".turn.assistant").children[-1], screen.query_one(SessionTable)
        assert abs(table.region.y - reply.region.y) >= 4, "the two changes are not rows apart"
        assert rendered == {type(reply).__name__: 1, "SessionTable": 1}
        assert terminal.differences(screen) == []


REPLY_PARTS = ["Merging ", "intervals, ", "*sorted ", "by start*:\n\n", "```python\n", "def merge(xs):\n",
               '    """Merge', ' them."""\n', "    return xs\n", "```\n\n", "Steps:\n\n", "1. **Sort** ", "them\n",
               "2. Merge ", "each ", "overlap\n", "3. ", "Done\n\n", "- a ", "bullet ", "point\n", "- and ", "another"]


async def test_a_redraw_that_only_grows_text_builds_no_widgets(monkeypatch):
    """Markdown.append builds the last block's widgets again from its parse at each redraw, in a task, and
    updates the old ones from them; a reply's redraw that only grows the text of a paragraph, code or a
    list's last item writes it into the widgets there. Widgets are built only for new blocks (and list
    items), and the terminal shows, after each redraw, the cells a full render has."""
    monkeypatch.setattr(session_view, "REPLY_INTERVAL_S", 0)
    terminal = ShadowTerminal(monkeypatch)
    built: list[str] = []
    init = MarkdownBlock.__init__
    monkeypatch.setattr(MarkdownBlock, "__init__", lambda self, *a, **k: built.append(type(self).__name__) or
                        init(self, *a, **k))
    async with make_app().run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        view = screen.active_view
        await view.begin_reply("hi")
        reply = view.query_one(".turn.assistant", Markdown)
        text, per_redraw = "", []
        for part in REPLY_PARTS:
            text += part
            built.clear()
            view.post_message(ReplyUpdated(view.session.session_id, text))
            await pilot.pause()
            per_redraw.append(len(built))
            assert terminal.differences(screen) == [], f"after {text!r}"
        # Built: a new block or list item, and an empty item's first text; nothing for the rest.
        starts = [i for i, part in enumerate(REPLY_PARTS) if i == 0 or part.startswith(("```p", "Steps", "1.", "2.",
                                                                                       "3.", "Done", "- "))]
        assert [i for i, n in enumerate(per_redraw) if n] == starts, f"widgets built per redraw: {per_redraw}"
        view.post_message(ReplyFinished(view.session.session_id, text, {"role": "assistant", "content": text}))
        await wait_for(pilot, lambda: not view.is_replying, what="the reply to finish")
        whole = Markdown(text, classes="turn assistant")
        whole.styles.border_left = reply.styles.border_left
        await view.query_one("#conversation").mount(whole)
        await pilot.pause(0.1)

        def shown(markdown: Markdown) -> list:  # each block as Textual's class, its size and its text
            return [(next(c.__name__ for c in type(w).__mro__ if c.__module__.startswith("textual.")), w.size,
                     w.symbol if isinstance(w, MarkdownBullet) else w._content) for w in
                    markdown.query("MarkdownBlock, MarkdownBullet")]

        assert shown(reply) == shown(whole)


class LinesHost(App):
    CSS = "Lines { width: 23; height: auto; }"

    def compose(self) -> ComposeResult:
        yield Lines()


class Lines(CachedLines, Static):
    pass


def _growing_texts(seed: int, steps: int = 120):
    """Contents as a streaming reply's blocks change: mostly grown by a word (long ones fold), now and then
    edited earlier (a closing mark restyles or removes text before the end), with tabs and line breaks."""
    rng = random.Random(seed)
    words = ["a", "to", "the", "blocks", "x" * 30, "\t", "tab\tbed", "end.\n", "", "  ", "paged-attention", "é"]
    styles = ["bold", "italic", "$text", ContentStyle.from_meta({"@click": "link('x')"}), "$accent"]
    text, spans = "", []
    for _ in range(steps):
        if text and rng.random() < 0.15:  # an edit before the end
            cut = rng.randrange(len(text))
            text = text[:cut] + text[cut + 1:]
            spans = [Span(s.start, min(s.end, len(text)), s.style) for s in spans if s.start < len(text)]
        word = rng.choice(words) + rng.choice(["", " ", " ", "  "])
        if rng.random() < 0.3:
            spans.append(Span(len(text), len(text) + len(word), rng.choice(styles)))
        if rng.random() < 0.1 and spans:
            first = spans.pop(rng.randrange(len(spans)))
            spans.append(Span(first.start, len(text) + len(word), first.style))  # a style that grows on
        text += word
        yield Content(text, spans=list(spans))


@pytest.mark.parametrize("seed", range(6))
async def test_cached_lines_render_the_strips_textual_renders(seed):
    """CachedLines wraps each update's text from the first row that may differ: after every update its rows
    are the strips Textual's render gives (offsets, links and all) and as many, at any width."""
    async with LinesHost().run_test(size=SIZE) as pilot:
        lines = pilot.app.query_one(Lines)
        for step, content in enumerate(_growing_texts(seed)):
            lines.update(content, layout=False)  # rows wrapped now, at the width laid out
            if step % 10 == 9:  # laid out again: at another width now and then
                lines.styles.width = 23 - step % 7 if step % 40 == 39 else lines.styles.width
                lines.refresh(layout=True)
                await pilot.pause()
            width = lines.size.width
            want = Visual.to_strips(lines, content, width, None, lines.visual_style)
            height = lines.get_content_height(lines.size, lines.size, width)
            assert height == len(want) == content.get_height(lines.styles, width)
            have = [lines.render_line(y) for y in range(height)]
            assert [list(s) for s in have] == [list(s) for s in want], f"step {step}: {content.plain!r}"


async def test_the_engines_objects_are_out_of_the_collectors_passes_while_the_chat_runs():
    """A pass over the oldest generation walks every object the process holds: the engine's (model,
    tokenizer, pools) are frozen out of them once it is loaded (each pass took 70 ms on the real model,
    holding the GIL the step loop needs), and given back when the app ends."""
    gc.unfreeze()
    async with make_app().run_test(size=SIZE) as pilot:
        await started(pilot)
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
