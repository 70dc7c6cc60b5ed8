"""Load progress as plain data, for a UI: which stage the loader is in and how many bytes of it are done.

The CLI keeps its tqdm bars (`progress=True`); a callback sees the same work as LoadProgress values,
from the loading thread, so a UI must hand them to its own thread (the chat posts a Textual message).
Stages in order, each only when needed: download -> verify -> convert -> load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

STAGES = ("download", "verify", "convert", "load")


class LoadProgress(NamedTuple):
    stage: str  # one of STAGES
    done: int  # bytes
    total: int  # bytes; 0 when unknown (a Hub download, loading the weights)


ProgressCallback = Callable[[LoadProgress], None]


def ignore(progress: LoadProgress) -> None:
    """The default callback: nobody is watching but the tqdm bars."""


def byte_counter(stage: str, total: int, on_progress: ProgressCallback) -> Callable[[int], None]:
    """A function to call with each chunk's size; it reports the running total."""
    done = 0

    def advance(num_bytes: int) -> None:
        nonlocal done
        done += num_bytes
        on_progress(LoadProgress(stage, done, total))

    return advance
