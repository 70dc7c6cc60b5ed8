"""Snapshots at 120x40 of the main screen, the engine panel and the help screen, on fixed data.

Update them with `pytest tests/test_ui_snapshots.py --snapshot-update` after a deliberate change,
and look at the report before committing.
"""

from __future__ import annotations

import pytest
from test_ui_app import wait_for
from textual.app import App, ComposeResult
from tiny_models import tiny_engine

from tinymlx.core.outputs import DiskCacheStats, EngineStats, KVGroupStats, RequestStats
from tinymlx_ui import ChatApp
from tinymlx_ui.messages import EngineSnapshot
from tinymlx_ui.monitor import EngineMonitor
from tinymlx_ui.screens.chat import ChatScreen
from tinymlx_ui.session import SessionSettings
from tinymlx_ui.store import HistoryStore
from tinymlx_ui.widgets import status_bar
from tinymlx_ui.widgets.block_map import BlockMap
from tinymlx_ui.widgets.engine_panel import EnginePanel
from tinymlx_ui.widgets.prompt_input import PromptInput

SIZE = (120, 40)
REPLY = """A paged KV cache stores keys and values in fixed-size **blocks**:

```python
block_table = [7, 2, 9]  # logical block i -> physical block
slot = block_table[pos // block_size] * block_size + pos % block_size
```

Sequences with the same prefix share its blocks."""


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_DATA", str(tmp_path / "data"))
    monkeypatch.setattr(status_bar, "process_memory", lambda: ("process", 512 << 20))  # live: would differ each run


def _history() -> None:
    store = HistoryStore()
    first = store.create_session(SessionSettings())
    first.title = "paged attention"
    store.save_session(first)
    store.add_turns(first.session_id, [{"role": "user", "content": "What is a paged KV cache?"},
                                       {"role": "assistant", "content": REPLY,
                                        "stats": "58 tokens · TTFT 0.21 s · 31.4 tok/s · 0/27 prompt tokens from cache"}])
    second = store.create_session(SessionSettings("Answer in one line."))
    second.title = "prefix cache"
    store.save_session(second)
    store.add_turns(second.session_id, [{"role": "user", "content": "Why cache prefixes?"},
                                        {"role": "assistant", "content": "So turn two reuses turn one's blocks.",
                                         "note": "(cut off: cancelled)"}])
    store.close()


async def _chat_ready(pilot) -> None:
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ChatScreen) and pilot.app.screen.query_one(BlockMap).data,
                   what="the block map's first figures")
    for prompt in pilot.app.screen.query(PromptInput):
        prompt.cursor_blink = False  # a blinking cursor would be in either state in the snapshot
    await pilot.pause(0.3)


def test_main_screen(snap_compare):
    _history()
    app = ChatApp(tiny_engine, model_label="tiny")
    assert snap_compare(app, terminal_size=SIZE, run_before=_chat_ready)


def test_help_screen(snap_compare):
    async def open_help(pilot):
        await _chat_ready(pilot)
        await pilot.press("f1")

    assert snap_compare(ChatApp(tiny_engine, model_label="tiny"), terminal_size=SIZE, run_before=open_help)


def _request(session_id: int, blocks: tuple[int, ...], num_output: int) -> RequestStats:
    return RequestStats(f"session-{session_id}-0", "running", 22, num_output, 16, 0.125 * session_id,
                        40.0 / session_id, (blocks,))


def _stats(step: int, requests: tuple[RequestStats, ...], cached: int) -> EngineStats:
    used = len({b for r in requests for table in r.block_tables for b in table})
    group = KVGroupStats(None, 2, 96, used, cached, (20, 21, 22, 23, 24)[:cached], 96 * 1024)
    return EngineStats(
        block_size=4, num_pages_total=96, num_pages_used=used, num_pages_cached=cached,
        num_pages_free=96 - used - cached, kv_groups=(group,), kv_cache_bytes=group.nbytes,
        num_running=len(requests), num_waiting=0,
        num_batched_tokens=len(requests), num_batched_seqs=len(requests), prefix_hit_rate=0.42,
        num_preemptions=1, num_steps=step, num_generated_tokens=step * len(requests),
        num_computed_prompt_tokens=40, requests=requests, weights_bytes=440 * 1024, kv_cache_bytes_used=used * 1024,
        kv_cache_bytes_budget=96 * 1024,
        disk_cache=DiskCacheStats("/cache/prefix-cache", True, 2 << 30, 3 << 20, 300, 12, 4, 2_400_000,
                                  7_200_000, 300, 0, 0, 0),
    )


def panel_data():
    """Two sessions share a 4-block system prompt; a third session's reply has finished and left
    cached blocks; the batch grows from one sequence to two."""
    monitor = EngineMonitor(window=40)
    sessions = [(1, "paged attention"), (2, "prefix cache"), (3, "done")]
    shared = (0, 1, 2, 3)
    finished = _request(3, (20, 21, 22, 23, 24), 4)
    data = monitor.sample(_stats(1, (finished,), 0), 0.0, sessions)
    for step in range(2, 30):
        first = _request(1, shared + tuple(range(4, 5 + step // 4)), step)
        requests = (first,) if step < 10 else (first, _request(2, shared + tuple(range(40, 41 + step // 8)), step - 9))
        data = monitor.sample(_stats(step, requests, 5), 0.1 * step, sessions)
    return data


class PanelHost(App):
    CSS_PATH = ChatApp.CSS_PATH

    def compose(self) -> ComposeResult:
        yield EnginePanel()

    def on_mount(self) -> None:
        self.query_one(EnginePanel).post_message(EngineSnapshot(panel_data()))


def test_engine_panel(snap_compare):
    assert snap_compare(PanelHost(), terminal_size=SIZE)
