"""EngineMonitor: turns the stream of EngineStats snapshots into what the engine panel draws.

Series grow only while the engine changes, so an idle minute does not scroll the last burst of
work off the graphs; throughput is measured over the last second of wall time either way. The time
the graphs cover is then the engine's busy time: each sample counts the time since the poll before it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tinymlx.core.outputs import EngineStats
from tinymlx_ui.block_ownership import BlockMapData, block_map_data
from tinymlx_ui.session import session_of_request


@dataclass(frozen=True)
class SessionRow:
    session_id: int
    title: str
    state: str  # "idle" | "waiting" | "running"
    ttft_s: float | None
    tokens_per_s: float | None


@dataclass(frozen=True)
class Series:
    pages_used: tuple[float, ...]  # the pool's pages
    pages_cached: tuple[float, ...]
    pages_free: tuple[float, ...]
    running: tuple[float, ...]
    batch_tokens: tuple[float, ...]
    tokens_per_s: tuple[float, ...]


@dataclass(frozen=True)
class PanelData:
    stats: EngineStats
    series: Series
    tokens_per_s: float
    sessions: tuple[SessionRow, ...]
    block_map: BlockMapData
    window_s: float = 0.0  # the busy time the series cover, idle gaps left out


class EngineMonitor:
    def __init__(self, window: int = 120, rate_window_s: float = 1.0):
        self._window, self._rate_window_s = window, rate_window_s
        self._series = {name: deque(maxlen=window) for name in Series.__dataclass_fields__}
        self._counts: deque[tuple[float, int]] = deque()  # (time, num_generated_tokens)
        self._last_key: tuple | None = None
        self._last_poll: float | None = None
        self._busy_s: deque[float] = deque(maxlen=window)  # per sample: time since the poll before it
        self._metrics: dict[int, tuple[float | None, float | None]] = {}  # session -> (ttft, tok/s)

    def record_reply(self, session_id: int, ttft_s: float | None, tokens_per_s: float | None) -> None:
        """A finished reply's exact metrics; they replace the last live ones the polls saw."""
        self._metrics[session_id] = (ttft_s, tokens_per_s)

    def sample(self, stats: EngineStats, now: float, sessions: list[tuple[int, str]]) -> PanelData:
        """`sessions`: (id, title) of the open sessions, in tab order."""
        rate = self._rate(stats.num_generated_tokens, now)
        key = (stats.num_steps, stats.num_pages_used, stats.num_pages_cached, stats.num_running, stats.num_waiting)
        if key != self._last_key:
            self._last_key = key
            for name, value in [
                ("pages_used", stats.num_pages_used), ("pages_cached", stats.num_pages_cached),
                ("pages_free", stats.num_pages_free), ("running", stats.num_running),
                ("batch_tokens", stats.num_batched_tokens), ("tokens_per_s", rate),
            ]:
                self._series[name].append(float(value))
            self._busy_s.append(0.0 if self._last_poll is None else now - self._last_poll)
        self._last_poll = now
        series = Series(**{name: self._padded(values) for name, values in self._series.items()})
        block_map = block_map_data(stats, session_of_request)
        return PanelData(stats, series, rate, self._session_rows(stats, sessions), block_map, sum(self._busy_s))

    def _rate(self, num_generated_tokens: int, now: float) -> float:
        self._counts.append((now, num_generated_tokens))
        while len(self._counts) > 2 and now - self._counts[1][0] >= self._rate_window_s:
            self._counts.popleft()
        (t0, n0), (t1, n1) = self._counts[0], self._counts[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def _padded(self, values: deque[float]) -> tuple[float, ...]:
        # Before the first sample nothing changed: pad with it, so the graph does not stretch or dip.
        if not values:
            return ()
        return (values[0],) * (self._window - len(values)) + tuple(values)

    def _session_rows(self, stats: EngineStats, sessions: list[tuple[int, str]]) -> tuple[SessionRow, ...]:
        live = {session_of_request(r.request_id): r for r in stats.requests}
        rows = []
        for session_id, title in sessions:
            request = live.get(session_id)
            if request is not None and request.ttft_s is not None:
                self._metrics[session_id] = (request.ttft_s, request.tokens_per_s)
            ttft, rate = self._metrics.get(session_id, (None, None))
            rows.append(SessionRow(session_id, title, request.status if request else "idle", ttft, rate))
        return tuple(rows)
