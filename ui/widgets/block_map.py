"""BlockMap: the KV pool as a grid of cells coloured by the session that holds each block.

    █ owned by one session (its colour)   ▓ shared by several (prefix cache)   ▒ cached, unreferenced   · free
    ▪ a hybrid's recurrent checkpoints (the pool's last pages: the caption counts them)

Two views, one key apart:
- zoomed (the default): only the blocks in use or cached, in block-id order, one block a cell while they
  fit; the free blocks are only counted in the caption. A chat on a 5,461-block pool fills one or
  two cells of the whole-pool view, which then reads as empty.
- whole pool: every block in order, the free ones too; where the pool has more blocks than the map has
  cells, one cell stands for several consecutive blocks.
A cell of several blocks shows the most telling state among them (shared > a session's, the one holding
most > cached > checkpoints > free). The first line is the title (view and scale), the last the caption (counts).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import groupby
from operator import itemgetter

from rich.segment import Segment
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

from tinymlx_ui.block_ownership import BlockMapData
from tinymlx_ui.widgets.colors import session_color
from tinymlx_ui.widgets.line_cache import KeyedLines, padding_style, parsed_style

SHARED, CACHED, FREE = ("▓", "bold #ffffff"), ("▒", "#c8a040"), ("·", "#5a5a5a")
STATES = ("▪", "#5f9ea0")
LEGEND = (("█ owned ", ""), ("▓ shared", SHARED[1]), (" ", ""), ("▒ cached", CACHED[1]), (" ", ""), ("· free", FREE[1]))
NUM_TEXT_LINES = 3  # title, legend, caption: the rest of the widget's height holds cells


@dataclass(frozen=True)
class MapLayout:
    title: str
    cells: tuple[tuple[str, str], ...]  # (glyph, style), row-major
    blocks_per_cell: int
    caption: str


def blocks_per_cell(num_blocks: int, width: int, height: int) -> int:
    return max(1, -(-num_blocks // max(1, width * height)))


def cell(data: BlockMapData, first: int, last: int) -> tuple[str, str]:
    """Glyph and style of the cell covering blocks first..last-1."""
    return cell_of(data, range(first, last))


def cell_of(data: BlockMapData, block_ids: Iterable[int]) -> tuple[str, str]:
    holders: Counter[int] = Counter()
    is_cached = is_state = False
    for block_id in block_ids:
        owners = data.owners.get(block_id, ())
        if len(owners) > 1:
            return SHARED
        holders.update(owners)
        is_cached = is_cached or block_id in data.cached
        is_state = is_state or block_id >= data.num_pages - data.num_state_pages
    if holders:
        return "█", session_color(holders.most_common(1)[0][0])
    return CACHED if is_cached else STATES if is_state else FREE


def working_set(data: BlockMapData) -> list[int]:
    """The blocks in use or cached, in block-id order: what the zoomed view shows."""
    return sorted(data.owners.keys() | data.cached)


def map_layout(data: BlockMapData, width: int, height: int, zoomed: bool) -> MapLayout:
    """The cells of a width x height map, with its title and caption."""
    num_used, num_cached = len(data.owners), len(data.cached - data.owners.keys())
    num_free = data.num_pages - num_used - num_cached - data.num_state_pages
    states = f" · {data.num_state_pages:,} checkpoint" if data.num_state_pages else ""
    if zoomed:
        blocks = working_set(data)
        per_cell = blocks_per_cell(len(blocks), width, height)
        cells = tuple(cell_of(data, blocks[i:i + per_cell]) for i in range(0, len(blocks), per_cell))
        caption = (f"{num_used:,} used · {num_cached:,} cached{states} · +{num_free:,} free blocks" if blocks
                   else f"no block in use{states} · {num_free:,} free" if states else f"all {data.num_pages:,} blocks free")
    else:
        per_cell = blocks_per_cell(data.num_pages, width, height)
        cells = tuple(cell(data, first, min(first + per_cell, data.num_pages))
                      for first in range(0, data.num_pages, per_cell))
        caption = f"{data.num_pages:,} blocks: {num_used:,} used · {num_cached:,} cached{states} · {num_free:,} free"
    scale = "1 block/cell" if per_cell == 1 else f"{per_cell:,} blocks/cell"
    title = f"Block map · {'zoomed' if zoomed else 'whole pool'} · {scale}"
    return MapLayout(title, cells, per_cell, caption)


class BlockMap(KeyedLines, Widget):
    """Drawn line by line: a snapshot each second redraws only the rows that changed (mostly the caption)."""

    COMPONENT_CLASSES = {"block-map--title"}
    data: reactive[BlockMapData | None] = reactive(None, repaint=False)
    zoomed: reactive[bool] = reactive(True, repaint=False)

    def watch_data(self) -> None:
        self.show_rows()

    def watch_zoomed(self) -> None:
        self.show_rows()

    def toggle_zoom(self) -> bool:
        self.zoomed = not self.zoomed
        return self.zoomed

    def layout_now(self) -> MapLayout | None:
        """The layout at the widget's current size (None before the first data)."""
        if self.data is None:
            return None
        return map_layout(self.data, self.size.width, self.size.height - NUM_TEXT_LINES, self.zoomed)

    def row_keys(self) -> list[tuple]:
        layout = self.layout_now()
        if layout is None:
            return []
        width, cells = max(1, self.size.width), layout.cells
        return [("title", layout.title), ("legend",),
                *(("cells", cells[i:i + width]) for i in range(0, len(cells), width)), ("caption", layout.caption)]

    def draw_row(self, key: tuple, width: int) -> Strip:
        style = self.rich_style
        if key[0] == "title":
            segments = [Segment(key[1], self.get_component_rich_style("block-map--title"))]
        elif key[0] == "caption":
            segments = [Segment(key[1], style + parsed_style("dim"))]
        else:  # the legend, or a row of cells: one segment for each run of one style
            runs = LEGEND if key[0] == "legend" else [
                ("".join(glyph for glyph, _ in run), cell_style) for cell_style, run in groupby(key[1], itemgetter(1))]
            segments = [Segment(text, style + parsed_style(cell_style)) for text, cell_style in runs]
        return Strip(segments).crop_extend(0, width, padding_style(style))
