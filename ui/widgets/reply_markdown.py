"""ReplyMarkdown: a reply's Markdown that, while it streams, redraws only what its new text changes.

Each redraw of a streaming reply updates its last block, and Textual relayouts the whole screen for each
update of a block (13-20 ms on a 2-core machine, then a second frame for the scroll that keeps the reply in
view). Here a block asks for a relayout only when its text outgrows the rows it was laid out with, and
then takes SPARE_ROWS more, so most new lines land in rows already laid out. A list grows in place: its
last item is updated and new items mounted after it (Textual remounts the whole list each redraw). Text
that only grows a paragraph, code or a list's last item goes straight into the widgets there (Textual
builds the last block's widgets again from each parse, in a task), and their rows are drawn line by line
(CachedLines): a redraw renders and repaints the rows its text changed.
"""

from __future__ import annotations

from markdown_it import MarkdownIt
from markdown_it.token import Token
from rich.cells import cell_len
from textual.await_complete import AwaitComplete
from textual.containers import Horizontal
from textual.geometry import Region
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Label, Markdown
from textual.widgets.markdown import MarkdownBlock, MarkdownFence

from tinymlx_ui.widgets.line_cache import CachedLines, padding_style

# Blank rows kept below a streaming reply's last line: a relayout every 8 lines, not each. With 4 the chat
# decoded at 0.92x of the engine alone, with 8 (and the panel drawn every 2 s) 0.97x (chat_overhead.py).
# The reply's left border (its session's bar) stops at its last line of text: drawn beside them, the spare
# rows were 8 empty quoted lines under the text (#55).
SPARE_ROWS = 8


class _ReplyParagraph(CachedLines, Markdown.BLOCKS["paragraph_open"]):  # Textual's MarkdownParagraph (not exported)
    def update(self, content="", *, layout: bool = True) -> None:
        super().update(content, layout=False)
        if layout and self.is_mounted:  # (not a block Markdown.append builds only to update one from)
            width = self.content_size.width
            self._markdown.fit(self, width and self.get_content_height(self.size, self.size, width))


class _CodeLabel(CachedLines, Label):
    pass


class _ReplyFence(MarkdownFence):
    def compose(self):
        yield _CodeLabel(self._highlighted_code, id="code-content", expand=True)  # as MarkdownFence's Label

    def set_content(self, content) -> None:
        self._content = content
        label = self.query(Label).first(Label) if self.is_mounted else None
        if label is not None:  # code does not wrap: its number of lines, and its longest line
            label.update(content, layout=False)
            lines = content.plain.split("\n")
            self._markdown.fit(label, len(lines), max(map(cell_len, lines), default=0))


class _GrowsInPlace:
    """A list's mixin, listed before its Textual class: Textual takes a widget's CSS type names from its first
    base that is a widget, and the list's rows need MarkdownBulletList's (or MarkdownOrderedList's) CSS (as a
    subclass of a plain MarkdownBlock, each row was as tall as the screen)."""

    async def _update_from_block(self, block: MarkdownBlock) -> None:
        """The same list with its last item grown, or items after it: update that item's blocks and mount
        the new items' rows. Any other change (another kind, fewer items, renumbered bullets) remounts it.
        Earlier items are left as they are: the text only grows, so only the last item can change."""
        rows = [child for child in self.children if isinstance(child, Horizontal)]
        items = list(block._blocks)  # compose takes them
        # A row is Horizontal(bullet, Vertical(*the item's blocks)), as compose builds it, not yet mounted.
        new_rows = list(block.compose()) if type(block) is type(self) else []
        if not rows or len(new_rows) < len(rows) or any(
                row.children[0].symbol != new._pending_children[0].symbol for row, new in zip(rows, new_rows)):
            block._blocks[:] = items  # mounted whole, it composes again
            await super()._update_from_block(block)
            return
        self._copy_context(block)
        column, new_blocks = rows[-1].children[1], new_rows[len(rows) - 1]._pending_children[1]._pending_children
        if [type(b) for b in column.children] == [type(b) for b in new_blocks]:
            for old, new in zip(column.children, new_blocks):
                await old._update_from_block(new)
        else:
            await column.remove_children()
            await column.mount_all(new_blocks)
        if len(new_rows) > len(rows):
            await self.mount_all(new_rows[len(rows):])


class _ReplyBulletList(_GrowsInPlace, Markdown.BLOCKS["bullet_list_open"]):
    pass


class _ReplyOrderedList(_GrowsInPlace, Markdown.BLOCKS["ordered_list_open"]):
    pass


_LISTS = {"bullet_list_open": _ReplyBulletList, "ordered_list_open": _ReplyOrderedList}
_SIMPLE_ITEM = ["list_item_open", "paragraph_open", "inline", "paragraph_close", "list_item_close"]


def _text_updates(block: MarkdownBlock, tokens: list[Token]) -> list[tuple[MarkdownBlock, Token, Token]] | None:
    """How to show `tokens` (the parse of the last block's source, grown) in `block`, that block's widget,
    when only text grew: (paragraph or code widget, its token, its inline token or None) for each widget
    Markdown.append would update (of a list, its last item: see _GrowsInPlace). None: anything else."""
    if not tokens or tokens[0].level != 0:
        return None
    top, kinds = tokens[0], [token.type for token in tokens]
    if kinds == ["paragraph_open", "inline", "paragraph_close"] and isinstance(block, _ReplyParagraph):
        return [(block, top, tokens[1])]
    if kinds in (["fence"], ["code_block"]) and isinstance(block, _ReplyFence):
        return [(block, top, None)]
    if type(block) is not _LISTS.get(top.type) or kinds[-1] != top.type.replace("_open", "_close"):
        return None
    items = [tokens[i:i + len(_SIMPLE_ITEM)] for i in range(1, len(tokens) - 1, len(_SIMPLE_ITEM))]
    rows = [child for child in block.children if isinstance(child, Horizontal)]
    if not items or len(items) != len(rows) or any([token.type for token in item] != _SIMPLE_ITEM for item in items):
        return None
    if [row.children[0].symbol for row in rows] != _bullets(block, [item[0] for item in items]):
        return None
    column = rows[-1].children[1].children
    if len(column) != 1 or not isinstance(column[0], _ReplyParagraph):
        return None
    return [(column[0], items[-1][1], items[-1][2])]


def _bullets(block: MarkdownBlock, items: list[Token]) -> list[str]:
    """The bullets MarkdownBulletList or MarkdownOrderedList.compose gives these top-level items."""
    if isinstance(block, _ReplyBulletList):
        return [block._markdown.BULLETS[0]] * len(items)
    try:
        start = int(items[0].info)
    except ValueError:
        start = 1
    numbers = range(start, start + len(items))
    width = max(len(f"{number}. ") for number in numbers)
    return [f"{number}. ".rjust(width + 1) for number in numbers]


class ReplyMarkdown(Markdown):
    """While it streams, the block it grows in keeps SPARE_ROWS blank rows below its text; they go when a
    new block starts or the reply ends. Its left border is drawn only beside its text, not beside them."""

    BLOCKS = {**Markdown.BLOCKS, "paragraph_open": _ReplyParagraph, "fence": _ReplyFence, "code_block": _ReplyFence,
              "bullet_list_open": _ReplyBulletList, "ordered_list_open": _ReplyOrderedList}

    def __init__(self, *args, streaming: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.is_streaming = streaming
        self._roomy: Widget | None = None  # the widget holding the spare rows
        self._text_rows = 0  # the rows of text in it, above its spare rows
        self._widened: set[Widget] = set()  # code whose longest line outgrew its width while streaming

    def append(self, markdown: str) -> AwaitComplete:
        """Markdown.append. When the text only grows the last block's text (a paragraph, code, a list's last
        item), it goes into the widgets already there, at once: Markdown.append builds the last block's widgets
        again from its parse, in a task of its own, and updates the old ones from them."""
        blocks = [child for child in self.children if isinstance(child, MarkdownBlock)]
        if blocks and not self.lock.is_locked:
            source, start = self.source + markdown, self._last_parsed_line
            parser = self._parser_factory() if self._parser_factory else MarkdownIt("gfm-like")
            tokens = parser.parse("".join(source.splitlines(keepends=True)[start:]))
            updates = _text_updates(blocks[-1], tokens)
            if updates:  # what Markdown.append sets: the source, where the next parse starts, the block's lines
                self._markdown, (first, end) = source, tokens[0].map
                self._last_parsed_line = start + first
                blocks[-1].source_range, blocks[-1]._token = (start + first, start + end), tokens[0]
                for widget, token, inline in updates:
                    widget._token = token
                    if inline is not None:
                        widget.set_content(widget._token_to_content(inline))
                    else:  # as a new MarkdownFence, then MarkdownFence._update_from_block
                        widget.code, widget.lexer = token.content.rstrip(), token.info
                        widget._highlighted_code = widget.highlight(widget.code, widget.lexer,
                                                                    ansi=self.app.native_ansi_color,
                                                                    dark=self.app.current_theme.dark)
                        widget.set_content(widget._highlighted_code)
                return AwaitComplete.nothing()
        return super().append(markdown)

    def fit(self, widget: Widget, height: int, width: int = 0) -> None:
        """Relayout `widget` (one of this reply's blocks, or its code) only if its text, `height` lines
        and `width` cells at most, no longer fits its laid-out content area; a streaming reply's grows
        with spare rows. Before its first layout (no width), always. Code wider than its block is cut
        there (out of sight but for a sideways scroll) until the next relayout, at the latest the end."""
        have = widget.content_size
        if not have.width or (width > have.width and not self.is_streaming):
            widget.refresh(layout=True)
        elif self.is_streaming and (height > have.height or (widget is not self._roomy and height < have.height)):
            if self._roomy is not None and self._roomy is not widget:
                self._roomy.styles.min_height = None
            self._set_roomy(widget, height)
            widget.styles.min_height = height + widget.styles.gutter.height + SPARE_ROWS  # relayouts
            return
        elif not self.is_streaming and height != have.height:
            widget.refresh(layout=True)
        elif width > have.width:
            self._widened.add(widget)
        if widget is self._roomy and height != self._text_rows:  # a line more (or less) in its spare rows
            old, self._text_rows = self._text_end(), height
            new = self._text_end()
            if old is not None and new is not None and old != new:
                self._refresh_border(min(old, new), abs(new - old))

    def _set_roomy(self, widget: Widget | None, text_rows: int = 0) -> None:
        """The spare rows are now `widget`'s (None: nobody's): its border is drawn again where it was not."""
        if widget is not self._roomy:
            self._refresh_border(0, self.size.height)
        self._roomy, self._text_rows = widget, text_rows

    def _text_end(self) -> int | None:
        """The row (of this widget's) below its streaming text, where its spare rows start; None: no spare rows."""
        roomy = self._roomy
        if roomy is None:
            return None
        top, own = roomy.content_region.y, self.region
        if not own or not roomy.region:  # not laid out yet
            return None
        return top - own.y + self._text_rows

    def _refresh_border(self, y: int, height: int) -> None:
        """Repaint the left border's rows y to y + height (refresh takes regions in content coordinates)."""
        width, (x, top) = self.styles.border.spacing.left, self.content_offset
        if width and height > 0:
            self.refresh(Region(-x, y - top, width, height))

    def render_lines(self, crop: Region) -> list[Strip]:
        """As Textual renders it, but with no left border beside the spare rows (below the text)."""
        strips = super().render_lines(crop)
        end, width = self._text_end(), self.styles.border.spacing.left
        if end is None or crop.x >= width or crop.bottom <= end:
            return strips
        cells = width - crop.x
        return [strip if y < end else _unbordered(strip, cells) for y, strip in enumerate(strips, crop.y)]

    def keep_room_in_last_block(self) -> None:
        """Spare rows only at the reply's end: a new block (or list item) after them would leave a gap."""
        node = self._roomy
        while node is not None and node is not self:
            if node.parent is None or node.parent.children[-1] is not node:
                self._roomy.styles.min_height = None
                self._set_roomy(None)
                return
            node = node.parent

    def end_stream(self) -> None:
        """Laid out to the whole text: no spare rows, code as wide as its longest line."""
        self.is_streaming = False
        if self._roomy is not None:
            self._roomy.styles.min_height = None
            self._set_roomy(None)
        for widget in self._widened:
            widget.refresh(layout=True)
        self._widened.clear()


def _unbordered(strip: Strip, cells: int) -> Strip:
    """`strip` with its first `cells` cells (a border) blank, in the background of the cell after them."""
    border, rest = strip.divide([cells, strip.cell_length])
    style = next((segment.style for segment in (*rest, *border) if segment.text and segment.style), None)
    return Strip.join([Strip.blank(cells, padding_style(style) if style else None), rest])
