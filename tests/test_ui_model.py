"""The UI's plain-data parts: block ownership against the real KV coordinator, the monitor's series
and rates, the block map's views and scaling, the graph labels, the history store and the session's prompt."""

from __future__ import annotations

import random

import pytest
from textual.app import App
from tiny_models import ByteTokenizer, tiny_engine, tiny_model

from tinymlx import SamplingParams
from tinymlx.core.config import EngineConfig
from tinymlx.core.outputs import EngineStats, KVGroupStats, RequestStats
from tinymlx.engine.engine import Engine
from tinymlx_ui import ChatApp
from tinymlx_ui.block_ownership import BlockMapData, block_map_data
from tinymlx_ui.monitor import EngineMonitor
from tinymlx_ui.session import ChatSession, SessionSettings, session_of_request, title_from
from tinymlx_ui.store import HistoryStore
from tinymlx_ui.widgets.block_map import (
    CACHED,
    FREE,
    SHARED,
    STATES,
    BlockMap,
    blocks_per_cell,
    cell,
    cell_of,
    map_layout,
)
from tinymlx_ui.widgets.colors import session_color
from tinymlx_ui.widgets.engine_panel import EnginePanel
from tinymlx_ui.widgets.graph_row import GraphRow, bar_lines, columns, scale_label, window_label


def _reference_cells(engine) -> tuple[dict[int, int], set[int]]:
    """({map cell: reference count}, cached cells) from the KV coordinator itself: a cell is a page of the
    shared pool, and each group's block holds `cost` of them."""
    refs, cached = {}, set()
    for group in engine.kv_coordinator.groups:
        evictable = set(group.prefix_cache.evictable_block_ids)
        for block_id, pages in enumerate(group.pages):
            if pages is not None:
                refs.update((page, group.ref_counts[block_id]) for page in pages)
                cached.update(pages if block_id in evictable else ())
    return refs, cached


@pytest.mark.parametrize(("seed", "cancel", "windowed"), [(0, False, False), (1, False, False), (2, False, False),
                                                        (0, True, False), (1, True, False), (0, False, True),
                                                        (1, True, True)])
def test_block_map_data_matches_the_kv_coordinator_every_step(seed, cancel, windowed):
    """`windowed`: a model with a sliding-window KV group beside its full-attention one (one pool)."""
    rng = random.Random(seed)
    engine = tiny_engine()
    if windowed:
        model = tiny_model(model_type="gemma3_text", sliding_window=8, sliding_window_pattern=2)
        engine = Engine(model, ByteTokenizer(), EngineConfig(block_size=4, num_pages=256))
        assert len(engine.kv_coordinator.groups) == 2 and len(engine.stats().kv_groups) == 2
    num_shared_seen = 0
    system = "You are a helpful assistant. " * 2  # a shared prefix: sessions share its blocks

    def step_and_compare():
        nonlocal num_shared_seen
        engine.step()
        data = block_map_data(engine.stats(), session_of_request)
        ref_counts, cached = _reference_cells(engine)
        assert data.cached == cached
        assert {c for c, refs in ref_counts.items() if refs > 0} == set(data.owners)
        for map_cell, owners in data.owners.items():
            assert len(owners) == ref_counts[map_cell]
        num_shared_seen += sum(len(owners) > 1 for owners in data.owners.values())

    for i in range(12):
        params = SamplingParams(temperature=0, max_tokens=rng.randint(3, 40), ignore_eos=True)
        engine.add_request(system + f"question {i}" * rng.randint(1, 3), params, request_id=f"session-{i % 3}-{i}")
        if cancel and i % 4 == 3:
            engine.abort(f"session-{(i - 1) % 3}-{i - 1}")
        for _ in range(rng.randint(0, 15)):
            step_and_compare()
    while engine.has_unfinished_requests:
        step_and_compare()
    assert num_shared_seen > 0 and len(_reference_cells(engine)[1]) > 0
    engine.check()


def _stats(num_steps=0, used=0, cached=0, generated=0, running=0, requests=(), total=16) -> EngineStats:
    group = KVGroupStats(None, 2, total, used, cached, tuple(range(total - cached, total)), total * 1024)
    return EngineStats(
        block_size=4, num_pages_total=total, num_pages_used=used, num_pages_cached=cached,
        num_pages_free=total - used - cached, kv_groups=(group,), kv_cache_bytes=group.nbytes,
        num_running=running, num_waiting=0, num_batched_tokens=running,
        num_batched_seqs=running, prefix_hit_rate=0.0, num_preemptions=0, num_steps=num_steps,
        num_generated_tokens=generated, num_computed_prompt_tokens=0, requests=requests,
    )


def test_monitor_samples_only_when_the_engine_changes_and_measures_tokens_per_second():
    monitor = EngineMonitor(window=5, rate_window_s=1.0)
    monitor.sample(_stats(), 0.0, [])
    monitor.sample(_stats(1, used=2, generated=10, running=1), 0.5, [])
    data = monitor.sample(_stats(2, used=3, generated=30, running=2), 1.0, [])
    assert data.series.pages_used == (0, 0, 0, 2, 3)  # padded with the first sample
    assert data.series.running == (0, 0, 0, 1, 2)
    assert data.tokens_per_s == pytest.approx(30.0)
    idle = monitor.sample(_stats(2, used=3, generated=30, running=2), 3.0, [])
    assert idle.series == data.series  # nothing changed: the graphs hold still
    assert idle.tokens_per_s == 0.0


def test_monitor_session_rows_keep_the_last_metrics_after_the_request_ends():
    monitor = EngineMonitor()
    live = RequestStats("session-7-ab", "running", 10, 5, 0, 0.25, 40.0, ((0, 1, 2),))
    rows = monitor.sample(_stats(1, used=3, requests=(live,)), 0.0, [(7, "chat"), (8, "other")]).sessions
    assert [(r.session_id, r.state, r.ttft_s, r.tokens_per_s) for r in rows] == [
        (7, "running", 0.25, 40.0), (8, "idle", None, None)]
    monitor.record_reply(7, 0.2, 50.0)
    rows = monitor.sample(_stats(2), 0.2, [(7, "chat")]).sessions
    assert (rows[0].state, rows[0].ttft_s, rows[0].tokens_per_s) == ("idle", 0.2, 50.0)


def test_block_map_cells_scale_and_rank_states():
    data = BlockMapData(10, {0: (1,), 1: (1, 2), 4: (2,), 5: (2,), 6: (1,)}, frozenset({8}))
    assert blocks_per_cell(10, 5, 2) == 1 and blocks_per_cell(10, 3, 2) == 2 and blocks_per_cell(5000, 40, 10) == 13
    assert cell(data, 0, 1) == ("█", session_color(1))
    assert cell(data, 0, 2) == SHARED  # one shared block marks the whole cell
    assert cell(data, 4, 7) == ("█", session_color(2))  # the session holding most blocks wins
    assert cell(data, 7, 9) == CACHED and cell(data, 9, 10) == FREE


def test_history_store_round_trip(tmp_path):
    store = HistoryStore(tmp_path / "h.sqlite3")
    first = store.create_session(SessionSettings("be brief", 0.3, 64, json_output=True))
    second = store.create_session(SessionSettings())
    store.add_turns(first.session_id, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "**yo**"}])
    first.title = "greeting"
    store.save_session(first)
    store.set_open(second.session_id, False)
    store.close()

    store = HistoryStore(tmp_path / "h.sqlite3")
    assert store.open_session_ids() == [first.session_id]
    loaded = store.load(first.session_id)
    assert loaded == ChatSession(first.session_id, "greeting", SessionSettings("be brief", 0.3, 64, json_output=True),
                                 [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "**yo**"}])
    assert [(s.session_id, s.num_turns, s.is_open) for s in store.summaries()] == [
        (first.session_id, 2, True), (second.session_id, 0, False)]
    with pytest.raises(KeyError):
        store.load(999)


def test_a_history_from_before_the_json_setting_opens_with_it_off(tmp_path):
    import sqlite3

    db = sqlite3.connect(tmp_path / "old.sqlite3")
    db.executescript("""
        CREATE TABLE sessions (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL, system_prompt TEXT NOT NULL,
            temperature REAL NOT NULL, max_tokens INTEGER NOT NULL, is_open INTEGER NOT NULL DEFAULT 1,
            updated REAL NOT NULL);
        INSERT INTO sessions (title, system_prompt, temperature, max_tokens, updated) VALUES ('old', 'hi', 0.5, 9, 0);
    """)
    db.commit()
    db.close()
    store = HistoryStore(tmp_path / "old.sqlite3")
    assert store.load(1).settings == SessionSettings("hi", 0.5, 9, json_output=False)


def test_session_prompt_is_the_whole_conversation_and_request_ids_map_back():
    session = ChatSession(3, settings=SessionSettings("sys", 0.0, 8),
                          turns=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])
    assert session.prompt_messages()[0] == {"role": "system", "content": "sys"}
    assert session.prompt_messages()[1:] == session.turns
    assert session_of_request(session.request_id("x1")) == 3
    assert session_of_request("req-5") is None and session_of_request("session-x-1") is None
    assert ChatSession(1, settings=SessionSettings("", 0.0, 8)).prompt_messages() == []
    assert title_from("  what is\n a   paged KV cache and why does it help?") == "what is a paged KV cach…"
    with pytest.raises(ValueError, match="temperature"):
        SessionSettings(temperature=-1).sampling_params()


def _large_pool_engine():
    """The default pool's 5,461 blocks with a few dozen in use (two replies running) and cached (two finished)."""
    engine = tiny_engine(num_pages=5461)
    system = "You are a helpful assistant. " * 2
    for i, max_tokens in enumerate([4, 8, 60, 60]):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(system + f"question {i} " * 8, params, request_id=f"session-{i + 1}-0")
    while engine.stats().num_running + engine.stats().num_waiting > 2:
        engine.step()
    return engine


def test_zoomed_block_map_shows_each_used_and_cached_block_of_a_large_pool():
    engine = _large_pool_engine()
    data = block_map_data(engine.stats(), session_of_request)
    bm = engine.kv_coordinator
    refs, cached = _reference_cells(engine)
    used = {c for c, count in refs.items() if count > 0}
    num_free = bm.num_pages - len(used) - len(cached)
    assert bm.num_pages == 5461 and 20 <= len(used) <= 100 and 20 <= len(cached) <= 100
    assert num_free == engine.stats().num_pages_free

    zoomed = map_layout(data, 40, 10, zoomed=True)
    assert zoomed.blocks_per_cell == 1 and zoomed.title == "Block map · zoomed · 1 block/cell"
    assert zoomed.cells == tuple(cell(data, b, b + 1) for b in sorted(used | cached))  # one cell each, in id order
    assert zoomed.cells.count(CACHED) == len(cached) and FREE not in zoomed.cells
    assert SHARED in zoomed.cells  # the system prompt's blocks, held by both running replies
    assert zoomed.caption == f"{len(used)} used · {len(cached)} cached · +{num_free:,} free blocks"

    whole = map_layout(data, 40, 10, zoomed=False)  # the whole pool scales as before
    per_cell = blocks_per_cell(5461, 40, 10)
    assert whole.blocks_per_cell == per_cell == 14 and whole.title == "Block map · whole pool · 14 blocks/cell"
    assert whole.cells == tuple(cell(data, first, min(first + 14, 5461)) for first in range(0, 5461, 14))
    assert whole.caption == f"5,461 blocks: {len(used)} used · {len(cached)} cached · {num_free:,} free"
    assert sum(c != FREE for c in whole.cells) < len(zoomed.cells) / 5  # why zooming: the work fills few cells
    engine.check()


def test_zoomed_block_map_scales_when_the_working_set_outgrows_the_map():
    owners = {b: (1,) for b in range(0, 600, 2)}  # 300 used, spread over the pool
    data = BlockMapData(5461, owners, frozenset(range(3000, 3100)))  # and 100 cached
    layout = map_layout(data, 10, 5, zoomed=True)
    blocks = sorted(owners) + list(range(3000, 3100))
    assert layout.blocks_per_cell == blocks_per_cell(400, 10, 5) == 8 and len(layout.cells) == 50
    assert layout.cells == tuple(cell_of(data, blocks[i:i + 8]) for i in range(0, 400, 8))
    assert layout.title == "Block map · zoomed · 8 blocks/cell"
    empty = map_layout(BlockMapData(5461, {}, frozenset()), 10, 5, zoomed=True)
    assert empty.cells == () and empty.caption == "all 5,461 blocks free"


def test_graph_scale_and_window_labels():
    assert scale_label([0, 3, 12.5]) == "max 12.5" and scale_label([5461.0, 5400.0]) == "max 5,461"
    assert scale_label([0.0, 123456.0]) == "max 123k" and scale_label([]) == "max 0"
    assert window_label(0) == "no activity yet" and window_label(2.94) == "last 2.9 s of activity"
    assert window_label(24.2) == "last 24 s of activity" and window_label(300) == "last 5.0 min of activity"
    # The bars rise from zero to the largest value, which the scale label names.
    assert columns([1, 2, 3], 6) == [1, 1, 2, 2, 3, 3] and columns(list(range(10)), 3) == [2, 5, 9]
    assert bar_lines([0, 1, 5, 10], 1, 10) == ["▁▁▄█"]
    assert bar_lines([0, 1, 5, 10], 2, 10) == ["   █", "▁▂██"]
    assert bar_lines([5440, 5461], 1, 5461) == ["██"]  # not a pool running dry


def test_monitor_window_is_the_busy_time_its_samples_cover():
    monitor = EngineMonitor(window=3)
    times = [0.0, 0.2, 0.4, 5.0, 5.2, 5.4]  # idle between 0.4 and 5.0: polls without a change
    changes = [1, 2, 3, 3, 4, 5]
    windows = [monitor.sample(_stats(step), now, []).window_s for now, step in zip(times, changes, strict=True)]
    # Each new sample adds the time since the poll before it, so the idle gap is left out; the window
    # keeps the last 3 samples: 0.2 + 0.2 at 0.4; then 0.2 (0.2 -> 0.4) + 0.2 (5.0 -> 5.2) + 0.2 (5.2 -> 5.4).
    assert windows == pytest.approx([0.0, 0.2, 0.4, 0.4, 0.6, 0.6])


@pytest.mark.asyncio
async def test_engine_panel_toggles_the_block_map_and_labels_its_graphs():
    class Host(App):
        CSS_PATH = ChatApp.CSS_PATH

        def compose(self):
            yield EnginePanel()

    engine = _large_pool_engine()
    monitor = EngineMonitor(window=40)
    sampled = []
    for now in (0.0, 0.2, 0.4):
        sampled.append(engine.stats())
        data = monitor.sample(sampled[-1], now, [(1, "a"), (2, "b")])
        engine.step()
    async with Host().run_test(size=(120, 40)) as pilot:
        panel = pilot.app.query_one(EnginePanel)
        panel.show(data)
        await pilot.pause()
        block_map = panel.query_one(BlockMap)

        def title() -> str:
            return block_map.render_line(0).text.rstrip()

        width, height = block_map.size.width, block_map.size.height - 3
        assert block_map.zoomed and title() == map_layout(data.block_map, width, height, True).title
        assert title() == "Block map · zoomed · 1 block/cell"
        assert panel.toggle_block_map_zoom() is False
        await pilot.pause()
        per_cell = blocks_per_cell(5461, width, height)
        assert per_cell > 1 and title() == f"Block map · whole pool · {per_cell} blocks/cell"
        assert panel.toggle_block_map_zoom() is True and title().startswith("Block map · zoomed")

        for row in panel.query(GraphRow):  # the scale drawn at the row's right end names its bars' maximum
            assert row.scale == scale_label(row.data) and row.render_line(0).text.rstrip().endswith(row.scale)
        scales = {row.id: row.scale for row in panel.query(GraphRow)}
        assert scales["used"] == f"max {max(s.num_pages_used for s in sampled)}"
        assert scales["free"] == f"max {max(s.num_pages_free for s in sampled):,}"
        assert str(panel.query_one("#blocks-title").render()) == "KV blocks · last 0.4 s of activity"
        assert str(panel.query_one("#batch-title").render()) == "Batch · last 0.4 s of activity"
    engine.check()


def test_a_hybrids_checkpoint_pages_are_drawn_and_counted_apart_from_the_free_ones():
    """The region at the pool's top (kv/block_pool.py) shows as its own cells in the whole pool, and the
    captions count it apart from the free pages."""
    data = BlockMapData(num_pages=40, owners={0: (1,), 1: (1, 2)}, cached=frozenset({2, 3}), num_state_pages=10)
    whole = map_layout(data, 10, 4, zoomed=False)
    assert whole.cells[:4] == (("█", session_color(1)), SHARED, CACHED, CACHED)
    assert whole.cells[4:30] == (FREE,) * 26 and whole.cells[30:] == (STATES,) * 10
    assert whole.caption == "40 blocks: 2 used · 2 cached · 10 checkpoint · 26 free"
    assert map_layout(data, 10, 4, zoomed=True).caption == "2 used · 2 cached · 10 checkpoint · +26 free blocks"

