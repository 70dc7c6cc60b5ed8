"""Widgets drawn line by line from the strips they keep, so an update repaints only the rows it changes.

CachedLines, for a Static's text (a reply's paragraphs and code). Textual renders all of a Static's text
again for each update, and repaints every row of it: one more word in a streaming reply's paragraph
re-rendered and repainted every row above it. Here an update wraps each changed source line as Textual
does (Content._wrap_and_format), from the first row that may differ from the line's last wrap (see
_Line.rows_kept), reuses the strips of the rows it finds again (a row's strip depends only on its text,
styles and place), and refreshes only the rows from the first that changed. The rows are the strips
Textual's own render gives (tests/test_ui_redraws.py compares them); with a text selection or aligned
content, the widget renders as Textual does.

KeyedLines, for a widget whose rows it describes itself (the engine panel's block map and session table):
each row has a key, what it is drawn from; a row is drawn once per key, and new data repaints the rows
whose key changed.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from os.path import commonprefix

from rich.style import Style
from textual.content import Content, Span
from textual.geometry import Region, Size
from textual.strip import Strip
from textual.visual import Visual, visualize


class CachedLines:
    """A mixin, listed before the Static class it draws (Textual takes a widget's CSS type names from its
    first base that is a widget: `class Paragraph(CachedLines, MarkdownParagraph)` keeps its CSS)."""

    _rows: list[Strip] | None = None  # the text's rows at the widget's size; None: render them again
    _wrapped = False  # the rows are the text's whole wrap (not cut to the widget's height)
    _lines: list[_Line] = []  # the last wrap, line by line (never mutated: each render makes a new list)
    _lines_for: tuple = ()  # what its rows were drawn with: width, styles, link style, wrap rules

    def update(self, content="", *, layout: bool = True) -> None:
        """With layout=False (the caller knows the size stays), only the rows that changed repaint."""
        old = self._rows
        if layout or old is None or not self.is_mounted:
            super().update(content, layout=layout)
            return
        self._Static__content = content  # what Static.update sets, without its refresh of every row
        self._Static__visual = visualize(self, content, markup=self._render_markup)
        self._layout_cache.clear()  # the visual Widget._render keeps
        self.clear_cached_dimensions()
        new = self._rows = self._render_rows()
        first = next((y for y, (a, b) in enumerate(zip(old, new)) if a is not b), min(len(old), len(new)))
        end = max(len(old), len(new))
        if first < end:
            self.refresh(Region(0, first, self.size.width, end - first))

    def _set_dirty(self, *regions: Region) -> None:
        if not regions:  # all of the widget: its size, styles or selection may have changed
            self._rows = None
        super()._set_dirty(*regions)

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._rows = None

    def render_line(self, y: int) -> Strip:
        if self._rows is None:
            self._rows = self._render_rows()
        self._dirty_regions.clear()  # as Widget._render_content does: the rows are up to date
        rows = self._rows
        return rows[y] if y < len(rows) else Strip.blank(self.size.width, self.visual_style.rich_style)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        if self._rows is not None and self._wrapped and width == self.size.width:
            return len(self._rows)
        return super().get_content_height(container, viewport, width)

    def _render_rows(self) -> list[Strip]:
        """As Visual.to_strips renders a Content (Content.render_strips, then link styles), each source line
        wrapped by Content._wrap_and_format, but from where its rows first may differ from its last wrap's."""
        (width, height), visual, style = self.size, self._render(), self.visual_style
        self._wrapped = False
        if self.text_selection is not None or not isinstance(visual, Content) or \
                self.styles.content_align != ("left", "top"):
            self._lines = []
            return Visual.to_strips(self, visual, width, height, style)
        rule = self.styles.get
        wrap = {"align": rule("text_align", "left"), "overflow": rule("text_overflow", "fold"),
                "no_wrap": rule("text_wrap", "wrap") == "nowrap", "line_pad": rule("line_pad", 0)}
        links = self.auto_links and not self.is_container and not self.screen._selecting
        link_style = self.link_style if links else None
        key = (width, style, link_style, *wrap.values())
        old_lines = self._lines if key == self._lines_for else []
        lines = []
        for y, line in enumerate(visual.split(allow_blank=True) if width else []):
            line, old = line.expand_tabs(8), old_lines[y] if y < len(old_lines) else None
            spans = tuple(line.spans)
            if old is None or (old.plain, old.spans) != (line.plain, spans):
                kept = old.rows_kept(line.plain, spans) if old is not None and not wrap["no_wrap"] else 0
                start = old.starts[kept] if kept else 0
                drawn = dict(zip(old.keys, old.strips)) if old is not None else {}
                new = _Line(line.plain, spans, *(list(part[:kept]) for part in (old.starts, old.keys, old.strips))
                            if kept else ([], [], []))
                for row in (line[start:] if start else line)._wrap_and_format(
                        width, tab_size=8, get_style=self._get_style, **wrap):
                    row.x, row.y = row.x + start, y  # as the whole text's wrap places it
                    row_key = (row.content.plain, tuple(row.content.spans), row.x, y, row.line_end)
                    strip = drawn.get(row_key)
                    if strip is None:
                        strip = Strip(*row.to_strip(style))
                        if links:
                            strip = strip._apply_link_style(link_style)
                    new.starts.append(row.x)
                    new.keys.append(row_key)
                    new.strips.append(strip)
                old = new
            lines.append(old)
        self._lines, self._lines_for, self._wrapped = lines, key, True
        return [strip for line in lines for strip in line.strips]


@dataclass
class _Line:
    """A source line of the text (tabs expanded), and its rows: where each starts, what it is drawn from, its strip."""

    plain: str
    spans: tuple[Span, ...]
    starts: list[int]
    keys: list[tuple]
    strips: list[Strip]

    def rows_kept(self, plain: str, spans: tuple[Span, ...]) -> int:
        """How many of this line's first rows the line wraps into again, now that it is `plain` and `spans`.

        The wrap (rich's divide_line) places words greedily, one after another: the words in a prefix the
        two texts share (a word ends where the next begins) break as they broke. So the rows before a row
        that starts with such a word stand, if the styles over them are the same; and the wrap of the text
        from that word on is the rest of the wrap. Not from inside a word folded over rows: its chunks are
        cut with its trailing blanks, which the wrap of its rest would not count.
        """
        shared = len(self.plain) if plain.startswith(self.plain) else len(commonprefix((self.plain, plain)))
        kept = bisect_right(self.starts, shared - 1) - 1  # rows starting in the shared prefix, but the last
        while kept > 0 and not _word_in(plain, self.starts[kept], shared):
            kept -= 1
        start = self.starts[kept] if kept > 0 else 0

        def before(spans: tuple[Span, ...]) -> list[tuple]:
            return [(span.start, min(span.end, start), span.style) for span in spans if span.start < start]

        return kept if kept > 0 and before(self.spans) == before(spans) else 0


class KeyedLines:
    """A mixin, listed before the Widget class it draws: `row_keys` says what each row is drawn from (hashable,
    compared), `draw_row` draws a row's strip, once per key; `show_rows`, after new data, repaints the rows
    whose key changed. The engine panel redraws each second, and most rows of its block map and session
    table stay as they were."""

    _keys: tuple = ()  # the rows' keys at _keys_for (the widget's size)
    _keys_for: Size | None = None
    _drawn: dict = {}  # key -> strip, for the keys shown (never mutated in place)
    _drawn_for: tuple = ()  # the width and style they were drawn at

    def row_keys(self) -> Sequence[Hashable]:
        """The rows' keys at the widget's current size, top row first."""
        raise NotImplementedError

    def draw_row(self, key: Hashable, width: int) -> Strip:
        raise NotImplementedError

    def show_rows(self) -> None:
        old, new = self._keys, self._keys_now(refresh=True)
        changed = [y for y in range(max(len(old), len(new))) if y >= len(old) or y >= len(new) or old[y] != new[y]]
        if changed:
            self.refresh(Region(0, changed[0], self.size.width, changed[-1] + 1 - changed[0]))

    def _keys_now(self, refresh: bool = False) -> tuple:
        if refresh or self._keys_for != self.size:
            self._keys, self._keys_for = tuple(self.row_keys()), self.size
            shown = set(self._keys)
            self._drawn = {key: strip for key, strip in self._drawn.items() if key in shown}
        return self._keys

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._drawn_for = ()  # drawn in the old colours

    def render_line(self, y: int) -> Strip:
        keys, width, style = self._keys_now(), self.size.width, self.rich_style
        if self._drawn_for != (width, style):
            self._drawn, self._drawn_for = {}, (width, style)
        if y >= len(keys):
            return Strip.blank(width, style)
        strip = self._drawn.get(keys[y])
        if strip is None:
            strip = self._drawn[keys[y]] = self.draw_row(keys[y], width)
        return strip


@lru_cache(maxsize=256)
def parsed_style(spec: str) -> Style:
    """A Rich style from its text ("bold #ffffff"), parsed once."""
    return Style.parse(spec)


def padding_style(style: Style) -> Style:
    """The style of the blanks after a line's text, as Textual pads a rendered line: the background only."""
    return Style(bgcolor=style.bgcolor)


_NEXT_WORD = re.compile(r"\s(?=\S)")  # the blank before a word's first character


def _word_in(plain: str, start: int, end: int) -> bool:
    """Whether a whole word of `plain` starts at `start` and ends (the next begins) before `end`."""
    return plain[start - 1].isspace() and not plain[start].isspace() and _NEXT_WORD.search(plain, start, end) is not None
