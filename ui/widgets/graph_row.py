"""GraphRow: a caption with the current value, a sparkline of its recent history, and the sparkline's scale.

The bars rise from zero to the largest value in the window, which is printed beside them ("max 37"):
Textual's Sparkline stretches min..max, so 5,440..5,461 free blocks would read as a pool running dry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from rich.cells import set_cell_size
from rich.segment import Segment
from rich.style import Style
from textual.color import Color
from textual.strip import Strip
from textual.widget import Widget

BARS = "▁▂▃▄▅▆▇█"
SHADES = 64  # of a graph's colour, from its faint low to its full high
CAPTION_WIDTH = 17  # "tokens/step 512"
SCALE_WIDTH = 10  # " max 5,461": one width for all rows, so the sparklines line up


def number(value: float) -> str:
    """Short, so the scale column keeps one width: 37, 12.5, 5,461, 120k."""
    if value >= 10_000:
        return f"{value / 1000:,.0f}k"
    return f"{value:,.0f}" if value >= 100 or float(value).is_integer() else f"{value:.1f}"


def scale_label(values: Sequence[float]) -> str:
    return f"max {number(max(values, default=0))}"


def window_label(window_s: float) -> str:
    """The time the graphs cover: the engine's busy time, as the series skip the polls where nothing changed."""
    if window_s <= 0:
        return "no activity yet"
    if window_s >= 120:
        return f"last {window_s / 60:.1f} min of activity"
    return f"last {window_s:.0f} s of activity" if window_s >= 10 else f"last {window_s:.1f} s of activity"


def columns(values: Sequence[float], width: int) -> list[float]:
    """The largest value under each of `width` columns (values repeat when there are fewer than columns)."""
    n = len(values)
    if n == 0:
        return []
    spans = [(c * n // width, max((c + 1) * n // width, c * n // width + 1)) for c in range(width)]
    return [max(values[lo:hi]) for lo, hi in spans]


def bar_lines(heights: Sequence[float], num_lines: int, maximum: float) -> list[str]:
    """Bars from zero to `maximum`, top line first; the bottom line always shows, so zero reads as a baseline."""
    levels = len(BARS) * num_lines
    eighths = [max(1, math.ceil(h / maximum * levels)) if maximum > 0 else 1 for h in heights]
    lines = []
    for row in reversed(range(num_lines)):  # row 0 is the bottom line
        fills = [min(len(BARS), e - len(BARS) * row) for e in eighths]
        lines.append("".join(BARS[f - 1] if f > 0 else " " for f in fills))
    return lines


class GraphRow(Widget):
    """One widget, drawn line by line: the caption, the sparkline and the scale of one series. The engine
    panel redraws all six rows each second; as a container of two labels and a Sparkline, a row was four
    widgets to render (and a Rich Text turned into Textual content cost about 1 ms a sparkline)."""

    COMPONENT_CLASSES = {"graph-row--scale"}

    def __init__(self, caption: str, color: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.caption, self.scale = caption, scale_label(())
        self.data: tuple[float, ...] = ()
        self._color = Color.parse(color)
        self._lines: tuple[tuple, list[Strip]] | None = None  # (what they were drawn from, the strips)

    def show(self, values: Sequence[float], caption: str) -> None:
        """New numbers: a repaint of this row, never a relayout (its size does not depend on them)."""
        values = tuple(values)
        if (values, caption) != (self.data, self.caption):
            self.data, self.caption, self.scale = values, caption, scale_label(values)
            self.refresh()

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._lines = None  # drawn in the old colours

    def render_line(self, y: int) -> Strip:
        width, num_lines = self.size.width, max(1, self.size.height)
        key = (self.data, self.caption, width, num_lines)
        if self._lines is None or self._lines[0] != key:
            self._lines = key, self._strips(width, num_lines)
        strips = self._lines[1]
        return strips[y] if 0 <= y < len(strips) else Strip.blank(width, self.rich_style)

    def _strips(self, width: int, num_lines: int) -> list[Strip]:
        """The caption and the scale on the first line, cut to their columns; the bars on every line."""
        style = self.rich_style
        bars = self._bar_segments(max(1, width - CAPTION_WIDTH - SCALE_WIDTH), num_lines, style)
        scale_style = self.get_component_rich_style("graph-row--scale")
        strips = []
        for y, line in enumerate(bars):
            caption = self.caption if y == 0 else ""
            scale = self.scale if y == 0 else ""
            segments = [Segment(set_cell_size(caption, CAPTION_WIDTH), style), *line,
                        Segment(" ", style), Segment(set_cell_size(scale, SCALE_WIDTH - 1), scale_style)]
            strips.append(Strip(segments).crop_extend(0, width, style))
        return strips

    def _bar_segments(self, width: int, num_lines: int, style: Style) -> list[list[Segment]]:
        heights = columns(self.data, width) or [0.0] * width  # no data yet: just the baseline
        maximum = max(heights, default=0)
        _, base = self.background_colors
        low, high = base + self._color.with_alpha(0.35), base + self._color
        # In 64 shades, which no eye tells apart: a few styles a graph, each built once (they took 1 ms a render).
        shades = [round(h / maximum * SHADES) if maximum else 0 for h in heights]
        styles = {shade: _shade_style(style, low, high, shade) for shade in set(shades)}
        lines = []
        for line in bar_lines(heights, num_lines, maximum):
            segments, start = [], 0
            for end in range(1, len(line) + 1):  # one segment per run of columns of one shade
                if end == len(line) or shades[end] != shades[start]:
                    segments.append(Segment(line[start:end], styles[shades[start]]))
                    start = end
            lines.append(segments)
        return lines


@lru_cache(maxsize=1024)
def _shade_style(style: Style, low: Color, high: Color, shade: int) -> Style:
    return style + Style.from_color(low.blend(high, shade / SHADES).rich_color)
