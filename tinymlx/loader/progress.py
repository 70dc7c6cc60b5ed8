"""Load progress as plain data, for a UI: which stage the loader is in and how many bytes of it are done.

The CLI keeps its tqdm bars (`progress=True`); a callback sees the same work as LoadProgress values,
from the loading thread, so a UI must hand them to its own thread (the chat posts a Textual message).
Stages in order, each only when needed: start (imports, finding the model) -> download -> verify ->
convert (reading the GGUF, then writing the weights) -> load (the weights) -> pool (allocating the KV pool).
Done and total are bytes, except convert's: the bytes it writes plus its reading, counted as the bytes
that take as long to write (see gguf.py), so its bar moves with the work; show it as a fraction.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable
from typing import NamedTuple

from tqdm import tqdm

STAGES = ("start", "download", "verify", "convert", "load", "pool")


class LoadProgress(NamedTuple):
    stage: str  # one of STAGES
    done: int  # bytes (convert's partly notional: see above)
    total: int  # bytes; 0 when unknown (a Hub download, loading the weights)

    @property
    def is_bytes(self) -> bool:
        """Whether done and total are real bytes, worth showing as such (convert's are partly notional)."""
        return self.stage != "convert"


ProgressCallback = Callable[[LoadProgress], None]


def ignore(progress: LoadProgress) -> None:
    """The default callback: nobody is watching but the tqdm bars."""


class StageMeter:
    """One stage's progress, for its terminal bar and the callback alike: it never goes back, never passes
    the total, and reports only what changed. Announces the stage (done 0) when made."""

    def __init__(self, stage: str, total: int, on_progress: ProgressCallback, bar: tqdm | None = None) -> None:
        """`bar`: the terminal's (None: the callback alone)."""
        self.stage, self.total, self.done = stage, total, 0
        self._on_progress, self._bar = on_progress, bar or tqdm(disable=True)
        on_progress(LoadProgress(stage, 0, total))

    def advance(self, num_bytes: int) -> None:
        self.reach(self.done + num_bytes)

    def reach(self, done: int) -> None:
        done = min(done, self.total)
        if done > self.done:
            self._bar.update(done - self.done)
            self.done = done
            self._on_progress(LoadProgress(self.stage, done, self.total))

    def __enter__(self) -> StageMeter:
        return self

    def __exit__(self, *exc) -> None:
        self._bar.close()


def progress_bar(iterable: Iterable | None = None, **kwargs) -> tqdm:
    """A tqdm bar on stderr. Where stderr is no terminal (a log, a pipe, CI) each refresh is a line of its
    own, at most every 10 s, instead of one line redrawn with carriage returns."""
    if not sys.stderr.isatty():
        kwargs = {"file": _Lines(), "mininterval": 10.0, **kwargs}
    return tqdm(iterable, **kwargs)


class _Lines:
    """A file for tqdm that turns each redraw into a plain line (cursor moves and blanking dropped)."""

    _REDRAW = re.compile(r"\x1b\[[0-9;]*[A-Za-z]|[\r\n]")

    def write(self, text: str) -> None:
        line = self._REDRAW.sub("", text).strip()
        if line:
            print(line, file=sys.stderr)

    def flush(self) -> None:
        sys.stderr.flush()
