"""SessionTable: each open session's state, time to first token and decode rate, sized to fit."""

from __future__ import annotations

from rich.segment import Segment
from textual.geometry import Size
from textual.reactive import reactive
from textual.strip import Strip
from textual.widget import Widget

from tinymlx_ui.monitor import SessionRow
from tinymlx_ui.widgets.colors import session_color
from tinymlx_ui.widgets.line_cache import KeyedLines, padding_style, parsed_style

_STATES = {"running": "run", "waiting": "wait", "idle": "idle"}
_FIXED = 2 + 5 + 7 + 8  # "● ", then state, TTFT and tok/s columns with their leading spaces


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}/s" if value < 10 else f"{value:.0f}/s"


class SessionTable(KeyedLines, Widget):
    """Drawn line by line: a snapshot each second redraws only the rows whose numbers changed."""

    COMPONENT_CLASSES = {"session-table--header"}
    DEFAULT_CSS = """
    SessionTable { height: auto; }
    SessionTable > .session-table--header { color: $accent; text-style: bold; }
    """
    # A relayout is a pass over the whole screen: only another number of rows changes the height.
    rows: reactive[tuple[SessionRow, ...]] = reactive((), repaint=False)

    def watch_rows(self, old: tuple[SessionRow, ...], new: tuple[SessionRow, ...]) -> None:
        self.show_rows()
        if len(old) != len(new):
            self.refresh(layout=True)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return 1 + len(self.rows)

    def row_keys(self) -> list[tuple]:
        width = max(4, self.size.width - _FIXED)  # the title takes what the numbers leave
        keys = [("header", f"{'Sessions':<{width + 2}} {'':<4} {'TTFT':>6} {'tok/s':>7}")]
        for row in self.rows:
            title = row.title if len(row.title) <= width else row.title[: width - 1] + "…"
            keys.append((row.session_id, f"{title:<{width}} ", f"{_STATES.get(row.state, row.state):<4}",
                         f" {_seconds(row.ttft_s):>6} {_rate(row.tokens_per_s):>7}"))
        return keys

    def draw_row(self, key: tuple, width: int) -> Strip:
        style = self.rich_style
        if key[0] == "header":
            segments = [Segment(key[1], self.get_component_rich_style("session-table--header"))]
        else:
            session_id, title, state, numbers = key
            segments = [Segment("● ", style + parsed_style(session_color(session_id))), Segment(title, style),
                        Segment(state, style + parsed_style("dim")), Segment(numbers, style)]
        return Strip(segments).crop_extend(0, width, padding_style(style))
