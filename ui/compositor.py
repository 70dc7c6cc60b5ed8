"""RowCompositor: Textual's compositor, drawing a partial update with only the screen rows it changes.

For each frame, Textual's compositor renders every widget whose parent's clip overlaps the box around the
frame's changes, and each of them in full: a reply growing by a word re-rendered the footer, the status
bar and all 38 rows of the engine panel, about 20 widgets a frame, though only the lines in that box are
sent to the terminal. Here a widget renders only its rows inside the regions the frame changes (not the
box around them all: a reply's new line and the panel's numbers in one frame would render every row
between the two, across the screen), and a widget outside them not at all; nor does one hidden, inside
them, behind a widget in front of it (the containers behind a reply's paragraph: half of a reply frame's
renders). Nothing else changes: the same cuts, in the same front-to-back order, so every line written is
the line the stock compositor writes (tests/test_ui_redraws.py compares them).
"""

from __future__ import annotations

from collections.abc import Iterable

from textual._compositor import ChopsUpdate, Compositor
from textual.geometry import Region
from textual.strip import Strip


class RowCompositor(Compositor):
    _regions: list[Region] | None = None  # the regions the partial update being drawn changes

    def render_partial_update(self) -> ChopsUpdate | None:
        self._regions = list(self._dirty_regions)  # Textual's update keeps only the box around them
        try:
            return super().render_partial_update()
        finally:
            self._regions = None

    def _get_renders(self, crop: Region | None = None) -> Iterable[tuple[Region, Region, list[Strip]]]:
        if crop is None or crop == self.size.region:  # a full update: as Textual does it
            yield from super()._get_renders(crop)
            return
        changed = [box for box in (region.intersection(crop) for region in self._regions or [crop]) if box]
        drawn: list[Region] = []  # the parts of the changed regions already drawn by widgets in front
        for widget, (region, clip) in self.visible_widgets.items():  # front to back
            visible = region.intersection(clip)
            # The chops keep the first strip of each cut, and a cut inside a changed region that this widget
            # reaches starts within any widget covering that part of it: a covered part adds nothing.
            parts = [part for part in (visible.intersection(box) for box in changed)
                     if part and not any(front.contains_region(part) for front in drawn)]
            if not parts:
                continue  # cannot touch a cell the frame writes: the cuts follow every widget's edges
            drawn.extend(parts)
            for top, bottom in _row_spans(parts):
                # The clip narrowed to those rows: _render_chops places the strips at region & clip.
                rows = Region(visible.x, top, visible.width, bottom - top)
                yield region, rows, widget.render_lines(rows.translate(-region.offset))


def _row_spans(parts: list[Region]) -> list[tuple[int, int]]:
    """The rows the parts cover, as (top, bottom) spans that neither overlap nor touch."""
    spans: list[list[int]] = []
    for top, bottom in sorted((part.y, part.bottom) for part in parts):
        if spans and top <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], bottom)
        else:
            spans.append([top, bottom])
    return [(top, bottom) for top, bottom in spans]
