"""LoadingScreen: shown while the model loads on a background thread, with the loader's real stage and progress."""

from __future__ import annotations

import time
from collections import deque

from textual.app import ComposeResult
from textual.containers import Center, Middle
from textual.screen import Screen
from textual.widgets import Label, ProgressBar

from tinymlx.loader.progress import STAGES, LoadProgress
from tinymlx_ui.widgets.status_bar import format_bytes

STAGE_TEXT = {
    "start": "Starting: imports, the terminal UI, finding the model",
    "download": "Downloading the model (first start only)",
    "verify": "Checking its sha256",
    "convert": "Converting the GGUF to float32 safetensors (first start only)",
    "load": "Loading the weights",
    "pool": "Allocating the KV pool",
}
SPEED_STAGES = ("download",)  # whose speed is worth a figure: the network's
SPEED_WINDOW_S = 5.0  # the speed shown is the last few seconds': steady, yet it follows a change


def stage_line(progress: LoadProgress, bytes_per_s: float | None = None) -> str:
    """The stage in words, with its bytes where they are real (convert's bar is a fraction), and a speed."""
    text = STAGE_TEXT.get(progress.stage, progress.stage)
    if not progress.total or not progress.is_bytes:
        return text
    line = f"{text}: {format_bytes(progress.done)} of {format_bytes(progress.total)}"
    return line if bytes_per_s is None else f"{line} · {format_speed(bytes_per_s)}"


def format_speed(bytes_per_s: float) -> str:
    if bytes_per_s >= 1 << 20:
        return f"{bytes_per_s / (1 << 20):.1f} MiB/s"
    return f"{bytes_per_s / 1024:.0f} KiB/s"


class SpeedMeter:
    """Bytes a second over the last SPEED_WINDOW_S, from one stage's (time, bytes done) reports."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, now: float, done: int) -> float | None:
        """Record a report; the speed so far, or None until the reports span half a second."""
        self._samples.append((now, done))
        while len(self._samples) > 2 and now - self._samples[1][0] >= SPEED_WINDOW_S:
            self._samples.popleft()
        then, done_then = self._samples[0]
        return (done - done_then) / (now - then) if now - then >= 0.5 else None


def stages_line(seen: list[str], seconds: dict[str, float] | None = None) -> str:
    """Every stage in order: done ones ticked with the seconds they took, the current one marked.
    A cached model skips straight from start to load."""
    seconds = seconds or {}
    marks = {stage: "✓ " for stage in seen[:-1]} | ({seen[-1]: "▸ "} if seen else {})
    return "  ·  ".join(
        f"{marks.get(stage, '')}{stage}" + (f" {seconds[stage]:.1f}s" if stage in seconds else "") for stage in STAGES
    )


class LoadingScreen(Screen):
    def __init__(self, model_label: str, started_at: float | None = None, note: str = "") -> None:
        """`started_at`: when the start stage began (time.monotonic(); default now), e.g. the process's start.
        `note`: why this model (the one used last, or why not that one)."""
        super().__init__()
        self._model_label, self._note = model_label, note
        self._started = time.monotonic() if started_at is None else started_at
        self._seen: list[str] = ["start"]  # stages reported so far, in order
        self._entered = [self._started]  # when each of them began
        self._seconds: dict[str, float] = {}  # how long each finished one took
        self._speed = SpeedMeter()  # the current stage's

    def compose(self) -> ComposeResult:
        with Middle(), Center():
            yield Label(f"Loading {self._model_label}", id="loading-title", markup=False)
            if self._note:
                yield Label(self._note, id="loading-note", markup=False)
            yield Label(stages_line(self._seen), id="loading-stages", markup=False)
            yield Label(STAGE_TEXT["start"], id="loading-stage", markup=False)
            with Center():  # its own: alignment centres the whole column, which the labels fill
                yield ProgressBar(total=None, show_eta=False, id="loading-progress")
            yield Label("", id="elapsed")

    def on_mount(self) -> None:
        self._tick()
        self.set_interval(0.5, self._tick)

    def show_progress(self, progress: LoadProgress) -> None:
        now = time.monotonic()
        if progress.stage not in self._seen:
            self._seconds[self._seen[-1]] = now - self._entered[-1]
            self._seen.append(progress.stage)
            self._entered.append(now)
            self._speed = SpeedMeter()
            self.query_one("#loading-stages", Label).update(stages_line(self._seen, self._seconds))
        speed = self._speed.add(now, progress.done) if progress.stage in SPEED_STAGES else None
        self.query_one("#loading-stage", Label).update(stage_line(progress, speed))
        # Total 0 means unknown: the bar then pulses instead of filling.
        self.query_one(ProgressBar).update(total=progress.total or None, progress=progress.done)

    def _tick(self) -> None:
        elapsed = time.monotonic() - self._started
        self.query_one("#elapsed", Label).update(f"{elapsed:.0f}s  ·  ctrl+q quits")
