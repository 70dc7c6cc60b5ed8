"""GraphRow: a caption with the current value, a sparkline of its recent history, and the sparkline's scale.

The bars rise from zero to the largest value in the window, which is printed beside them ("max 37"):
Textual's Sparkline stretches min..max, so 5,440..5,461 free blocks would read as a pool running dry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.color import Color
from textual.containers import Horizontal
from textual.widgets import Label, Sparkline

from tinymlx_ui.widgets.text_update import set_text

BARS = "▁▂▃▄▅▆▇█"


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


class ZeroBasedSparkline(Sparkline):
    def render(self) -> Text:
        width, num_lines = self.size.width, max(1, self.size.height)
        heights = columns(self.data or (), width) or [0.0] * width  # no data yet: just the baseline
        maximum = max(heights, default=0)
        _, base = self.background_colors
        low, high = base + self.min_color, base + self.max_color
        shades = [h / maximum if maximum else 0 for h in heights]
        # One style per distinct shade, and one span per run of columns of one shade (not one per cell).
        styles = {shade: Style.from_color(low.blend(high, shade).rich_color) for shade in set(shades)}
        text = Text(no_wrap=True, overflow="crop")
        for index, line in enumerate(bar_lines(heights, num_lines, maximum)):
            if index:
                text.append("\n")
            start = 0
            for end in range(1, len(line) + 1):  # one span per run of columns of one shade
                if end == len(line) or shades[end] != shades[start]:
                    text.append(line[start:end], styles[shades[start]])
                    start = end
        return text


class GraphRow(Horizontal):
    def __init__(self, caption: str, color: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self._caption, self._color = caption, color

    def compose(self) -> ComposeResult:
        yield Label(self._caption, classes="caption", markup=False)
        color = Color.parse(self._color)
        yield ZeroBasedSparkline([], min_color=color.with_alpha(0.35), max_color=color)
        yield Label("", classes="scale", markup=False)

    def show(self, values: Sequence[float], caption: str) -> None:
        set_text(self.query_one(".caption", Label), caption)
        set_text(self.query_one(".scale", Label), scale_label(values))
        self.query_one(Sparkline).data = values  # reassigned, never mutated: reactive needs a new object
