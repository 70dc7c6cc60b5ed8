"""The UI's plain-data parts: block ownership against the real block manager, the monitor's series
and rates, the block map's scaling, the history store and the session's prompt."""

from __future__ import annotations

import random

import pytest
from tiny_models import tiny_engine

from tinymlx import SamplingParams
from tinymlx.outputs import EngineStats, RequestStats
from tinymlx_ui.block_ownership import BlockMapData, block_map_data
from tinymlx_ui.monitor import EngineMonitor
from tinymlx_ui.session import ChatSession, SessionSettings, session_of_request, title_from
from tinymlx_ui.store import HistoryStore
from tinymlx_ui.widgets.block_map import CACHED, FREE, SHARED, blocks_per_cell, cell
from tinymlx_ui.widgets.colors import session_color


def _real_cached(engine) -> set[int]:
    bm = engine.block_manager
    return {b for b in range(bm.num_blocks) if bm.ref_counts[b] == 0 and bm.prefix_cache.is_evictable(b)}


@pytest.mark.parametrize(("seed", "cancel"), [(0, False), (1, False), (2, False), (0, True), (1, True)])
def test_block_map_data_matches_the_block_manager_every_step(seed, cancel):
    rng = random.Random(seed)
    engine = tiny_engine()
    num_shared_seen = 0
    system = "You are a helpful assistant. " * 2  # a shared prefix: sessions share its blocks

    def step_and_compare():
        nonlocal num_shared_seen
        engine.step()
        data = block_map_data(engine.stats(), session_of_request)
        bm = engine.block_manager
        assert data.cached == _real_cached(engine)
        assert {b for b in range(bm.num_blocks) if bm.ref_counts[b] > 0} == set(data.owners)
        for block_id, owners in data.owners.items():
            assert len(owners) == bm.ref_counts[block_id]
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
    assert num_shared_seen > 0 and len(_real_cached(engine)) > 0
    engine.check()


def _stats(num_steps=0, used=0, cached=0, generated=0, running=0, requests=(), total=16) -> EngineStats:
    return EngineStats(
        block_size=4, num_blocks_total=total, num_blocks_used=used, num_blocks_cached=cached,
        num_blocks_free=total - used - cached, cached_block_ids=tuple(range(total - cached, total)), num_running=running, num_waiting=0, num_batched_tokens=running,
        num_batched_seqs=running, prefix_hit_rate=0.0, num_preemptions=0, num_steps=num_steps,
        num_generated_tokens=generated, num_computed_prompt_tokens=0, requests=requests,
    )


def test_monitor_samples_only_when_the_engine_changes_and_measures_tokens_per_second():
    monitor = EngineMonitor(window=5, rate_window_s=1.0)
    monitor.sample(_stats(), 0.0, [])
    monitor.sample(_stats(1, used=2, generated=10, running=1), 0.5, [])
    data = monitor.sample(_stats(2, used=3, generated=30, running=2), 1.0, [])
    assert data.series.blocks_used == (0, 0, 0, 2, 3)  # padded with the first sample
    assert data.series.running == (0, 0, 0, 1, 2)
    assert data.tokens_per_s == pytest.approx(30.0)
    idle = monitor.sample(_stats(2, used=3, generated=30, running=2), 3.0, [])
    assert idle.series == data.series  # nothing changed: the graphs hold still
    assert idle.tokens_per_s == 0.0


def test_monitor_session_rows_keep_the_last_metrics_after_the_request_ends():
    monitor = EngineMonitor()
    live = RequestStats("session-7-ab", "running", 10, 5, 0, 0.25, 40.0, (0, 1, 2))
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
