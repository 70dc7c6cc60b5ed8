"""Updating a text widget without a needless relayout: each relayout is a pass over the whole screen."""

from __future__ import annotations

from rich.cells import cell_len
from textual.widgets import Static


def set_text(widget: Static, text: str) -> None:
    """Update a Label or Static: nothing when the text is the same, and a relayout (a pass over the
    whole screen) only when its height may change: another number of lines, or a line that may wrap."""
    old = str(widget.content)
    if text == old:
        return
    width = widget.content_size.width
    same_height = bool(old) and text.count("\n") == old.count("\n") and all(
        cell_len(line) <= width for line in (*text.splitlines(), *old.splitlines()))
    widget.update(text, layout=not same_height)
