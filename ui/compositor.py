"""RowCompositor: Textual's compositor, drawing a partial update with only the screen rows it changes.

For each frame, Textual's compositor renders every widget whose parent's clip overlaps the box around the
frame's changes, and each of them in full: a reply growing by a word re-rendered the footer, the status
bar and all 38 rows of the engine panel, about 20 widgets a frame, though only the lines in that box are
sent to the terminal. Here a widget renders only its rows inside the box, and a widget outside the box
not at all; nor does one hidden, inside the box, behind a widget in front of it (the containers behind a
reply's paragraph: half of a reply frame's renders). Nothing else changes: the same cuts, in the same
front-to-back order, so every line written is the line the stock compositor writes (tests/test_ui_redraws.py
compares them).
"""

from __future__ import annotations

from collections.abc import Iterable

from textual._compositor import Compositor
from textual.geometry import Region
from textual.strip import Strip


class RowCompositor(Compositor):
    def _get_renders(self, crop: Region | None = None) -> Iterable[tuple[Region, Region, list[Strip]]]:
        if crop is None or crop == self.size.region:  # a full update: as Textual does it
            yield from super()._get_renders(crop)
            return
        top, bottom = crop.y, crop.bottom
        drawn: list[Region] = []  # the parts of the box already drawn by widgets in front
        for widget, (region, clip) in self.visible_widgets.items():  # front to back
            x, y, width, height = region.intersection(clip)
            if not (width and height and crop.overlaps(Region(x, y, width, height))):
                continue  # cannot touch a cell inside the box: the cuts follow every widget's edges
            # The clip narrowed to the box's rows: _render_chops places the strips at region & clip.
            y0, y1 = max(y, top), min(y + height, bottom)
            row_clip = Region(x, y0, width, y1 - y0)
            # The chops keep the first strip of each cut, and a cut inside the box that this widget's
            # part of it reaches starts within any widget covering that part: a covered widget adds nothing.
            inside = row_clip.intersection(crop)
            if any(front.contains_region(inside) for front in drawn):
                continue
            drawn.append(inside)
            yield region, row_clip, widget.render_lines(Region(x - region.x, y0 - region.y, width, y1 - y0))
