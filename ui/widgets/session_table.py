"""SessionTable: each open session's state, time to first token and decode rate, sized to fit."""

from __future__ import annotations

from rich.text import Text
from textual.reactive import reactive
from textual.widget import Widget

from tinymlx_ui.monitor import SessionRow
from tinymlx_ui.widgets.colors import session_color

_STATES = {"running": "run", "waiting": "wait", "idle": "idle"}
_FIXED = 2 + 5 + 7 + 8  # "● ", then state, TTFT and tok/s columns with their leading spaces


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}/s" if value < 10 else f"{value:.0f}/s"


class SessionTable(Widget):
    COMPONENT_CLASSES = {"session-table--header"}
    DEFAULT_CSS = """
    SessionTable { height: auto; }
    SessionTable > .session-table--header { color: $accent; text-style: bold; }
    """
    # A relayout is a pass over the whole screen: only another number of rows changes the height.
    rows: reactive[tuple[SessionRow, ...]] = reactive(())

    def watch_rows(self, old: tuple[SessionRow, ...], new: tuple[SessionRow, ...]) -> None:
        if len(old) != len(new):
            self.refresh(layout=True)

    def render(self) -> Text:
        width = max(4, self.size.width - _FIXED)  # the title takes what the numbers leave
        header = f"{'Sessions':<{width + 2}} {'':<4} {'TTFT':>6} {'tok/s':>7}"
        lines = [Text(header, style=self.get_component_rich_style("session-table--header"))]
        for row in self.rows:
            title = row.title if len(row.title) <= width else row.title[: width - 1] + "…"
            lines.append(Text.assemble(
                ("● ", session_color(row.session_id)), f"{title:<{width}} ",
                (f"{_STATES.get(row.state, row.state):<4}", "dim"),
                f" {_seconds(row.ttft_s):>6} {_rate(row.tokens_per_s):>7}",
            ))
        return Text("\n").join(lines)
