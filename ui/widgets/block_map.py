"""BlockMap: the KV pool as a grid of cells coloured by the session that holds each block.

    █ owned by one session (its colour)   ▓ shared by several (prefix cache)   ▒ cached, unreferenced   · free

With more blocks than cells, one cell stands for several consecutive blocks and shows the most
telling state among them (shared > a session's, the one holding most > cached > free).
"""

from __future__ import annotations

from collections import Counter

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from tinymlx_ui.block_ownership import BlockMapData
from tinymlx_ui.widgets.colors import session_color

SHARED, CACHED, FREE = ("▓", "bold #ffffff"), ("▒", "#c8a040"), ("·", "#5a5a5a")
LEGEND = Text.assemble("█ owned ", ("▓ shared", SHARED[1]), " ", ("▒ cached", CACHED[1]), " ", ("· free", FREE[1]))


def blocks_per_cell(num_blocks: int, width: int, height: int) -> int:
    return max(1, -(-num_blocks // max(1, width * height)))


def cell(data: BlockMapData, first: int, last: int) -> tuple[str, str]:
    """Glyph and style of the cell covering blocks first..last-1."""
    holders: Counter[int] = Counter()
    is_cached = False
    for block_id in range(first, last):
        owners = data.owners.get(block_id, ())
        if len(owners) > 1:
            return SHARED
        holders.update(owners)
        is_cached = is_cached or block_id in data.cached
    if holders:
        return "█", session_color(holders.most_common(1)[0][0])
    return CACHED if is_cached else FREE


class BlockMap(Widget):
    data: reactive[BlockMapData | None] = reactive(None)

    def render(self) -> Text:
        if self.data is None:
            return Text("")
        num_blocks, width = self.data.num_blocks, self.size.width
        per_cell = blocks_per_cell(num_blocks, width, self.size.height - 1)  # the last line is the caption
        text = Text(no_wrap=True, overflow="crop")
        for index, first in enumerate(range(0, num_blocks, per_cell)):
            if index and index % width == 0:
                text.append("\n")
            text.append(*cell(self.data, first, min(first + per_cell, num_blocks)))
        scale = "1 cell = 1 block" if per_cell == 1 else f"1 cell = {per_cell} blocks"
        text.append(f"\n{num_blocks} blocks, {scale}", style="dim")
        return text
