"""The chat UI driven through Pilot on the tiny engine: concurrent streams, graphs, cancel, history,
settings, sessions, and the start-up screens; and once on the real default model."""

from __future__ import annotations

import dataclasses
import functools
import re
import threading
import time
from pathlib import Path

import pytest
from textual.geometry import Region
from textual.widgets import Collapsible, Markdown, Static, TabbedContent
from tiny_models import ByteTokenizer, save_byte_tokenizer, save_dir, tiny_engine, tiny_model

from tinymlx.core.config import EngineConfig
from tinymlx.engine.engine import Engine
from tinymlx.loader import OFFLINE_MODELS
from tinymlx_ui import ChatApp
from tinymlx_ui.screens import chat as chat_screen
from tinymlx_ui.screens.chat import PANEL_REDRAW_S, ChatScreen
from tinymlx_ui.screens.error import ErrorScreen
from tinymlx_ui.screens.help import HelpScreen
from tinymlx_ui.screens.models import ModelChoice, ModelsScreen, available_models
from tinymlx_ui.screens.sessions import SessionsScreen
from tinymlx_ui.screens.settings import SettingsScreen
from tinymlx_ui.session import SessionSettings
from tinymlx_ui.store import HistoryStore
from tinymlx_ui.widgets.block_map import BlockMap
from tinymlx_ui.widgets.graph_row import GraphRow
from tinymlx_ui.widgets.prompt_input import PromptInput
from tinymlx_ui.widgets.session_table import SessionTable
from tinymlx_ui.widgets.session_view import SessionView, printable
from tinymlx_ui.widgets.status_bar import StatusBar, format_bytes, kv_memory_text

pytestmark = pytest.mark.asyncio
SIZE = (120, 40)


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_DATA", str(tmp_path / "data"))
    return tmp_path / "data"


def make_app(max_tokens: int = 32, step_delay_s: float = 0.0) -> ChatApp:
    def factory():
        engine = tiny_engine()
        if step_delay_s:  # the tiny model is so fast that a reply could end before the next one starts
            step = engine.step
            engine.step = lambda: time.sleep(step_delay_s) or step()
        return engine

    return ChatApp(factory, model_label="tiny",
                   defaults=SessionSettings("Be brief.", temperature=0.0, max_tokens=max_tokens))


async def wait_for(pilot, condition, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.05)


async def started(pilot, timeout: float = 30.0) -> ChatScreen:
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ChatScreen), timeout, what="the chat screen")
    await pilot.pause()
    return pilot.app.screen


async def send(pilot, text: str, timeout: float = 30.0) -> None:
    """Type into the focused prompt, press Enter and wait for the whole reply."""
    view = pilot.app.screen.active_view
    await pilot.press(*text, "enter")
    await wait_for(pilot, lambda: not view.is_replying, timeout, what="the reply")


def submit(pilot, text: str) -> None:
    """Like `send`, without waiting: Pilot's key presses wait for the app to go idle, which a
    streaming reply postpones until it ends, so they cannot start a second stream beside a first."""
    prompt = pilot.app.screen.active_view.query_one(PromptInput)
    prompt.insert(text)
    prompt.action_submit()


def views(screen: ChatScreen) -> list[SessionView]:
    return list(screen.query(SessionView))


def turns_shown(view: SessionView) -> list[tuple[str, str]]:
    shown = []
    for widget in view.query(".turn"):
        if isinstance(widget, Markdown):
            shown.append(("assistant", widget.source))
        else:
            shown.append(("user", str(widget.render())))
    return shown


async def test_two_sessions_stream_at_once_and_the_panel_graphs_them():
    app = make_app(max_tokens=300, step_delay_s=0.005)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        submit(pilot, "first question")
        await screen.action_new_session()
        submit(pilot, "second question")
        await pilot.pause(0.05)
        first, second = views(screen)
        assert screen.query_one(TabbedContent).active == f"session-{second.session.session_id}"
        lengths: dict[SessionView, set[int]] = {first: set(), second: set()}

        def both_done() -> bool:
            for view in (first, second):
                replies = view.query(".turn.assistant")
                if replies:
                    lengths[view].add(len(replies.last(Markdown).source))
            return not first.is_replying and not second.is_replying

        await wait_for(pilot, both_done, what="both replies")
        # The reply in view streams; the one in the background tab is drawn whole when it ends (or is shown).
        assert len(lengths[second]) > 3, "the reply did not stream: it arrived in too few pieces"
        for view in (first, second):
            reply = view.session.turns[1]["content"]
            assert len(view.session.turns) == 2 and reply
            assert turns_shown(view)[-1] == ("assistant", printable(reply))

        def drawn_graphs() -> dict[str, tuple[float, ...]]:
            return {row.id: row.data for row in screen.query(GraphRow)}

        # The panel draws at most every PANEL_REDRAW_S: wait for the snapshot after both replies ended.
        await wait_for(pilot, lambda: drawn_graphs()["used"][-1] == 0 and max(drawn_graphs()["cached"]) > 0,
                       timeout=2 * PANEL_REDRAW_S + 2, what="the panel to draw the blocks released and cached")
        graphs = drawn_graphs()
        assert max(graphs["running"]) == 2, "the two replies never ran in the same batch"
        assert max(graphs["used"]) > 0 and min(graphs["free"]) < 256 and max(graphs["tokens"]) >= 2
        assert max(graphs["rate"]) > 0
        rows = screen.query_one(SessionTable).rows
        assert [row.title for row in rows] == ["first question", "second question"]
        assert all(row.ttft_s > 0 and row.tokens_per_s > 0 for row in rows)
        assert screen.query_one(BlockMap).data.cached, "finished replies leave cached prefix blocks"
        app.async_engine.check()


def last_reply(view: SessionView) -> str:
    replies = view.query(".turn.assistant")
    return replies.last(Markdown).source if replies else ""


def notes(view: SessionView) -> list[str]:
    return [str(note.render()) for note in view.query(".note")]


async def test_escape_cancels_the_reply_and_frees_its_blocks(data_dir):
    app = make_app(max_tokens=900, step_delay_s=0.002)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        view = screen.active_view
        submit(pilot, "a long answer please")
        await wait_for(pilot, lambda: len(last_reply(view)) > 10, what="the reply to start")
        assert app.async_engine.stats().num_pages_used > 0
        await pilot.press("escape")
        await wait_for(pilot, lambda: not view.is_replying, what="the cancel")
        stats = app.async_engine.stats()
        await wait_for(pilot, lambda: app.async_engine.stats().num_pages_used == 0, what="the blocks")
        app.async_engine.check()
        assert stats.num_generated_tokens < 900 and app.async_engine.stats().num_running == 0
        assert notes(view) == ["(cut off: cancelled)"]
        partial = view.session.turns[-1]["content"]
        assert partial and printable(partial) == last_reply(view)
    # The partial reply is history too, marked as cut off.
    saved = HistoryStore().load(view.session.session_id).turns[-1]
    assert saved["content"] == partial and saved["note"] == "(cut off: cancelled)"


async def test_closing_a_streaming_session_aborts_it_and_keeps_its_history():
    app = make_app(max_tokens=900, step_delay_s=0.002)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        closed = screen.active_view
        await pilot.press("ctrl+n")
        kept = screen.active_view
        await pilot.press("ctrl+pageup")
        assert screen.active_view is closed
        submit(pilot, "a long answer please")
        await wait_for(pilot, lambda: len(last_reply(closed)) > 10, what="the reply to start")
        await pilot.press("ctrl+w")
        assert views(screen) == [kept] and screen.active_view is kept
        await wait_for(pilot, lambda: app.async_engine.stats().num_pages_used == 0, what="the blocks")
        app.async_engine.check()
        assert app.async_engine.stats().num_generated_tokens < 900
    store = HistoryStore()
    assert store.open_session_ids() == [kept.session.session_id]
    assert [t["role"] for t in store.load(closed.session.session_id).turns] == ["user", "assistant"]


async def test_history_survives_a_restart_and_closed_sessions_can_be_reopened():
    app = make_app(max_tokens=16)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        await send(pilot, "remember me")
        await pilot.press("ctrl+n")
        await send(pilot, "and me")
        before = {v.session.session_id: (v.session.title, turns_shown(v)) for v in views(screen)}
        assert [title for title, _ in before.values()] == ["remember me", "and me"]
        assert all(len(shown) == 2 for _, shown in before.values())

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        assert {v.session.session_id: (v.session.title, turns_shown(v)) for v in views(screen)} == before
        first_id = next(iter(before))
        screen.query_one(TabbedContent).active = f"session-{first_id}"
        await pilot.pause()
        await pilot.press("ctrl+w")
        assert [v.session.session_id for v in views(screen)] != list(before)

    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        assert len(views(screen)) == 1
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, SessionsScreen)
        options = app.screen.query_one("OptionList")
        assert options.option_count == 2
        options.highlighted = [options.get_option_at_index(i).id for i in range(2)].index(str(first_id))
        await pilot.press("enter")
        assert app.screen is screen and screen.active_view.session.session_id == first_id
        assert turns_shown(screen.active_view) == before[first_id][1]


async def test_each_turn_sends_the_whole_conversation_so_the_prefix_cache_reuses_it():
    app = make_app(max_tokens=16)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        turn_one = screen.active_view.session.prompt_messages() + [{"role": "user", "content": "turn one"}]
        await send(pilot, "turn one")
        assert app.async_engine.stats().prefix_hit_rate == 0.0
        await send(pilot, "turn two")
        session = screen.active_view.session
        assert session.prompt_messages()[: len(turn_one)] == turn_one and len(session.turns) == 4
        tokenizer = app.async_engine.engine.tokenizer
        first = len(tokenizer.apply_chat_template(turn_one))
        second = len(tokenizer.apply_chat_template(session.prompt_messages()[:-1]))
        block_size = app.async_engine.stats().block_size
        # At least turn one's full prompt blocks were served from the cache on turn two.
        assert app.async_engine.stats().prefix_hit_rate >= (first - 1) // block_size * block_size / (first + second)


def parallel_chat(tmp_path, num_layers: int = 2, **parallel) -> ChatApp:
    """The chat over a tiny model on several ranks (`parallel`: the EngineConfig's sizes)."""
    model_dir = save_dir(tmp_path / "m", tiny_model(num_hidden_layers=num_layers))
    engine_config = EngineConfig(block_size=4, num_pages=256, **parallel)
    return ChatApp(functools.partial(Engine.load, model_dir, ByteTokenizer(), engine_config, "tiny"),
                   model_label="tiny", defaults=SessionSettings("Be brief.", temperature=0.0, max_tokens=8))


async def test_tensor_parallel_engine_shows_its_all_reduces(tmp_path):
    """The same UI over a 2-rank engine: the status bar says so, the panel counts the all-reduces,
    and quitting gives the ranks back."""
    app = parallel_chat(tmp_path, tensor_parallel_size=2)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        engine = app.async_engine.engine
        await send(pilot, "hi")
        assert "TP 2 ranks" in str(screen.query_one(StatusBar).render())
        layers = engine.runner.model.args.num_hidden_layers
        expected = f"TP 2  all-reduce {2 * layers}/step"  # the panel draws at most every PANEL_REDRAW_S
        await wait_for(pilot, lambda: expected in str(screen.query_one("#counters").render()),
                       timeout=2 * PANEL_REDRAW_S + 2, what=f"the panel to show {expected!r}")
    assert engine.runner.ranks._owner is None  # released on quit


async def test_pipeline_parallel_engine_shows_its_stages(tmp_path):
    """The same UI over two pipeline stages: the status bar says so, the panel shows each stage's layers, memory
    and busy time, the bytes sent and the bubble, and quitting stops the stage worker."""
    app = parallel_chat(tmp_path, num_layers=4, pipeline_parallel_size=2)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        (worker,) = app.async_engine.engine.pipeline.pids
        await send(pilot, "hi")
        assert "PP 2 stages" in str(screen.query_one(StatusBar).render())
        shown = re.compile(r"PP 2  bubble \d+%  [\d.]+ MB/step.*\n  stage 0 layers 0-1 on 127\.0\.0\.1: weights .*busy "
                           r"[\d.]+ s\n  stage 1 layers 2-3 on 127\.0\.0\.1")
        await wait_for(pilot, lambda: shown.search(str(screen.query_one("#counters").render())),
                       timeout=2 * PANEL_REDRAW_S + 2, what="the panel to show the stages")
    assert not Path(f"/proc/{worker}").exists() or "zombie" in Path(f"/proc/{worker}/status").read_text().lower()


async def panel_shows(factory, label: str, message: str, max_tokens: int, pattern: str, what: str,
                      slack_s: float = 2) -> None:
    """Send `message` on the engine `factory` builds; wait until the panel's counters match `pattern`
    (the panel draws at most every PANEL_REDRAW_S)."""
    app = ChatApp(factory, model_label=label,
                  defaults=SessionSettings("Be brief.", temperature=0.0, max_tokens=max_tokens))
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        await send(pilot, message)
        shown = re.compile(pattern)
        await wait_for(pilot, lambda: shown.search(str(screen.query_one("#counters").render())),
                       timeout=2 * PANEL_REDRAW_S + slack_s, what=what)


async def test_status_bar_panel_and_stats_give_the_same_memory_figures(monkeypatch):
    """Mid-reply, the engine held still: the status bar and the engine panel show the KV bytes in use, as
    allocated and the budget exactly as stats() gives them, and the panel's block counts are those bytes."""
    monkeypatch.setattr(chat_screen, "PANEL_REDRAW_S", 0.0)
    held, resume = threading.Event(), threading.Event()

    def factory():
        engine = tiny_engine(num_pages=1024)  # a pool that grows: allocated lies between used and budget
        step = engine.step

        def step_then_hold():
            outputs = step()
            if engine.num_generated_tokens >= 20 and not resume.is_set():
                held.set()
                resume.wait(30)
            return outputs

        engine.step = step_then_hold
        return engine

    app = ChatApp(factory, model_label="tiny", defaults=SessionSettings("Be brief.", temperature=0.0, max_tokens=200))
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        submit(pilot, "a question long enough to hold several blocks of the pool " * 4)
        await wait_for(pilot, held.is_set, what="the engine to hold mid-reply")
        try:
            stats = app.async_engine.engine.stats()
            kv = kv_memory_text(stats.kv_cache_bytes_used, stats.kv_cache_bytes, stats.kv_cache_bytes_budget)
            bar, counters, used = (screen.query_one(StatusBar), screen.query_one("#counters"),
                                   screen.query_one("#used", GraphRow))
            await wait_for(pilot, lambda: kv in str(bar.render()) and kv in " ".join(
                str(counters.render()).split()), what="the status bar and the panel to show stats()'s KV figures")
            assert 0 < stats.kv_cache_bytes_used < stats.kv_cache_bytes < stats.kv_cache_bytes_budget
            assert f"weights {format_bytes(stats.weights_bytes)}" in str(counters.render())
            # the graphs count blocks: the same figures, in blocks of one size
            assert f"used {stats.num_pages_used}/{stats.num_pages_total}" in str(used.render_line(0).text)
            block_bytes = stats.kv_cache_bytes_budget // stats.num_pages_total
            assert stats.kv_cache_bytes_used == stats.num_pages_used * block_bytes
            assert stats.kv_cache_bytes == app.async_engine.engine.runner.kv_cache.nbytes
        finally:
            resume.set()
        await wait_for(pilot, lambda: not screen.active_view.is_replying, what="the reply")
        app.async_engine.check()


async def test_a_hybrid_model_shows_its_state_slots_and_checkpoints():
    """Qwen3.5's kind of model: the panel counts the recurrent state slots in use and the checkpoints kept."""
    model = tiny_model(model_type="qwen3_5_text", num_hidden_layers=4, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                       linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)
    await panel_shows(lambda: Engine(model, ByteTokenizer(), EngineConfig(block_size=4, num_pages=256, max_num_seqs=8,
                                                                            num_state_checkpoints=8)),
                      "tiny-hybrid", "hi", 8, r"state slots 0/8  checkpoints [1-8]/8 in \d+ pages",
                      "the panel to count the state slots")


async def test_both_proposers_show_their_acceptance_apart():
    """ngram+draft: the panel shows each proposer's share of drafts kept beside the overall one."""
    config = EngineConfig(block_size=4, num_pages=256, speculative="ngram+draft:other,adaptive=0")
    await panel_shows(lambda: Engine(tiny_model(), ByteTokenizer(), config, draft_model=tiny_model(seed=5)),
                      "tiny", "abcabcabcabcabcabc", 24,
                      r"speculative ngram\+draft  accepted \d+%.*\n  ngram \d+% of \d+  draft \d+% of \d+",
                      "the panel to show each proposer's acceptance", slack_s=4)


async def test_a_base_model_without_a_chat_template_continues_the_conversations_text():
    """No chat template (a base model such as gemma-3-270m): each turn sends the conversation as one text,
    system prompt first, which the model continues; the status bar says so."""
    prompts = []

    def factory():
        engine = tiny_engine()
        engine.tokenizer.has_chat_template = False
        add_request = engine.add_request
        engine.add_request = lambda prompt, *args, **kwargs: prompts.append(prompt) or add_request(prompt, *args, **kwargs)
        return engine

    app = ChatApp(factory, model_label="tiny", defaults=SessionSettings("Once upon a time,", temperature=0.0,
                                                                      max_tokens=8))
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        assert "base model: continues your text" in str(screen.query_one(StatusBar).render())
        await send(pilot, "there was a cat")
        reply = screen.active_view.session.turns[-1]["content"]
        await send(pilot, "and a dog")
        decode = ByteTokenizer().decode  # the prompts reach the engine as token ids
        assert decode(prompts[0]) == "Once upon a time, there was a cat"
        joint = "" if reply[-1].isspace() else " "
        assert decode(prompts[1]) == f"Once upon a time, there was a cat{reply}{joint}and a dog"
        assert len(reply) > 0 and app.async_engine.stats().prefix_hit_rate > 0  # turn 2 extends turn 1's text


async def test_settings_change_the_system_prompt_and_sampling_and_are_saved():
    app = make_app(max_tokens=64)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        view = screen.active_view
        await pilot.press("f2")
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#system-prompt-input").text = "Answer in French."
        app.screen.query_one("#temperature").value = "-1"
        app.screen.query_one("#max-tokens").value = "5"
        await pilot.click("#save")
        assert isinstance(app.screen, SettingsScreen)
        assert "temperature" in str(app.screen.query_one("#settings-error").render())
        app.screen.query_one("#temperature").value = "0"
        app.screen.query_one("#json-output").value = True
        await pilot.press("ctrl+s")
        assert app.screen is screen
        assert view.session.settings == SessionSettings("Answer in French.", 0.0, 5, json_output=True)
        assert "Answer in French." in str(view.query_one("#system-prompt").render())
        await send(pilot, "bonjour")
        assert app.async_engine.stats().num_generated_tokens == 5 and notes(view) == ["(stopped at max tokens)"]
        assert view.session.prompt_messages()[0] == {"role": "system", "content": "Answer in French."}
        # The random tiny model opens a JSON object only because the reply is constrained to one.
        assert view.session.turns[-1]["content"].lstrip().startswith("{")
    saved = HistoryStore().load(view.session.session_id).settings
    assert saved == SessionSettings("Answer in French.", 0.0, 5, json_output=True)


async def test_a_refused_request_is_reported_and_leaves_no_turn():
    app = make_app(max_tokens=1000)  # the prompt plus 1000 tokens exceeds the tiny model's 1024 context
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        view = screen.active_view
        await send(pilot, "too long")
        assert not view.is_replying and view.session.turns == []
        assert len(notes(view)) == 1 and notes(view)[0].startswith("error:") and "max_tokens" in notes(view)[0]
        assert turns_shown(view) == []
        assert view.query_one(PromptInput).text == "too long"  # the message is not lost: edit it and resend
        assert HistoryStore().load(view.session.session_id).turns == []


async def test_help_screen_lists_the_keys_and_the_palette_runs_commands():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        await pilot.press("question_mark")  # typed into the prompt, not a shortcut there
        assert app.screen is screen and screen.active_view.query_one(PromptInput).text == "?"
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        text = " ".join(str(label.render()) for label in app.screen.query("#help-keys Label"))
        for binding in [*ChatScreen.BINDINGS, *PromptInput.BINDINGS, *ChatApp.BINDINGS]:
            assert (binding.tooltip or binding.description) in text
        for keys in ["esc", "^j", "f2", "^n", "^w", "^p"]:
            assert keys in text
        await pilot.press("escape")
        assert app.screen is screen
        await pilot.press("ctrl+p")
        await pilot.press(*"New session")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(views(screen)) == 2, what="the palette's new session")


async def test_a_bad_model_path_shows_an_error_screen(tmp_path):
    missing = tmp_path / "no-such-model"
    app = ChatApp(lambda: Engine.from_config(EngineConfig(model=str(missing)), progress=False), model_label="x")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen), what="the error screen")
        assert "no such file or directory" in app.screen.error and str(missing) in app.screen.error
        await pilot.press("q")
    assert app.return_code == 2  # the shell sees that the chat never started


async def test_an_unexpected_load_failure_shows_an_error_screen_too():
    def broken():
        raise RuntimeError("weights are corrupt")

    app = ChatApp(broken, model_label="x")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen), what="the error screen")
        assert app.screen.error == "RuntimeError: weights are corrupt"


@pytest.mark.real_model
async def test_the_real_default_model_answers_in_the_ui(default_model_dir):
    # default_model_dir (conftest) fetches and converts the default model once; the app then finds it
    # the way `tinymlx chat` does, through EngineConfig(model=None).
    config = EngineConfig(num_pages=512)
    app = ChatApp(functools.partial(Engine.from_config, config, progress=False),
                  defaults=SessionSettings("You are a helpful assistant.", temperature=0.0, max_tokens=24))
    async with app.run_test(size=SIZE) as pilot:
        view = (await started(pilot, timeout=600)).active_view
        await send(pilot, "What is the capital of France? Answer in one word.", timeout=300)
        reply = view.session.turns[-1]["content"]
        assert "paris" in reply.lower() and last_reply(view) == reply
        await send(pilot, "And of Italy?", timeout=300)
        assert "rome" in view.session.turns[-1]["content"].lower()
        assert app.async_engine.stats().prefix_hit_rate > 0  # turn two reused turn one's blocks
        app.async_engine.check()


async def test_a_turn_sent_while_another_session_streams_is_shown_at_once():
    """The user's turn appears in its session within a moment, however busy the other session is."""
    app = make_app(max_tokens=600, step_delay_s=0.02)  # every prompt + 600 fits the tiny model's context
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        first = screen.active_view
        submit(pilot, "\n".join("-" * 40))  # a conversation taller than the view
        await wait_for(pilot, lambda: len(last_reply(first)) > 5, what="the first reply to start")
        screen.action_cancel_reply()
        await wait_for(pilot, lambda: not first.is_replying, what="the first reply to end")
        assert len(first.session.turns) == 2
        await screen.action_new_session()
        second = screen.active_view
        submit(pilot, "a long story please")
        await wait_for(pilot, lambda: len(last_reply(second)) > 20, what="the second session streaming")
        screen.action_previous_session()
        await pilot.pause(0.05)
        assert screen.active_view is first
        conversation = first.query_one("#conversation")
        for question in ("first question", "second question"):
            conversation.release_anchor()  # the user scrolled up to read
            conversation.scroll_home(immediate=True, animate=False)
            await pilot.pause(0.05)
            submit(pilot, question)
            sent = time.monotonic()
            # "At once", with room for a loaded 2-core CI machine; the bug held the turn back for >= 9 s.
            await wait_for(pilot, lambda q=question: ("user", q) in turns_shown(first), timeout=3.0,
                           what="the user turn in the view")
            turn = [w for w in first.query(".turn.user") if str(w.render()) == question][0]
            await wait_for(pilot, lambda t=turn: conversation.region.overlaps(t.region), timeout=3.0,
                           what="the user turn on screen")
            assert time.monotonic() - sent < 3.0
            assert second.is_replying, "the other session stopped streaming: the test proves nothing"
            screen.action_cancel_reply()
            await wait_for(pilot, lambda: not first.is_replying, what="the first session's reply to end")


def stats_lines(view: SessionView) -> list[str]:
    return [str(line.render()) for line in view.query(".stats")]


async def test_regenerate_reuses_the_conversation_from_the_prefix_cache_and_replaces_the_reply():
    app = make_app(max_tokens=12)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        view = screen.active_view
        await send(pilot, "hello there")
        first = view.session.turns[-1]
        assert re.fullmatch(r"12 tokens · TTFT [\d.]+ s · [\d.]+ tok/s · 0/\d+ prompt tokens from cache",
                            stats_lines(view)[0]), stats_lines(view)
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: not view.is_replying and len(view.session.turns) == 2, what="the new reply")
        assert view.session.turns[-1]["content"] == first["content"]  # greedy: the same reply again
        cached, prompt = map(int, re.search(r"(\d+)/(\d+) prompt tokens", stats_lines(view)[0]).groups())
        assert cached > 0 and cached <= prompt, "the regenerated prompt did not come from the prefix cache"
        assert len(view.query(".turn")) == 2 and len(stats_lines(view)) == 1
        assert [t["role"] for t in HistoryStore().load(view.session.session_id).turns] == ["user", "assistant"]


async def test_edit_last_puts_the_message_back_and_resending_replaces_the_exchange():
    app = make_app(max_tokens=6)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        view = screen.active_view
        await send(pilot, "first")
        await send(pilot, "secnod")
        await pilot.press("ctrl+l")
        assert view.query_one(PromptInput).text == "secnod"
        assert [t["content"] for t in view.session.turns if t["role"] == "user"] == ["first"]
        assert len(view.query(".turn")) == 2
        view.query_one(PromptInput).text = ""
        await send(pilot, "second")
        assert [t["content"] for t in view.session.turns if t["role"] == "user"] == ["first", "second"]
        saved = HistoryStore().load(view.session.session_id).turns
        assert [t["content"] for t in saved if t["role"] == "user"] == ["first", "second"] and len(saved) == 4


async def test_copy_reply_copy_code_and_export(data_dir):
    app = make_app(max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        view = screen.active_view
        await send(pilot, "hi")
        await pilot.press("ctrl+g")
        assert app.clipboard == view.session.turns[-1]["content"]
        view.session.turns[-1]["content"] = "Here:\n```python\nprint(1)\n```\nand\n```\nx = 2\n```\n"
        await pilot.press("ctrl+b")
        assert app.clipboard == "x = 2\n"
        await pilot.press("ctrl+s")
        exported = list((data_dir / "exports").glob("*.md"))
        assert len(exported) == 1
        text = exported[0].read_text()
        assert text.startswith("# hi") and "## You\n\nhi" in text and "## Assistant" in text and "x = 2" in text


async def test_a_reply_cut_off_by_quitting_is_marked_in_history():
    app = make_app(max_tokens=900, step_delay_s=0.01)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        view = screen.active_view
        submit(pilot, "a long answer please")
        await wait_for(pilot, lambda: len(last_reply(view)) > 10, what="the reply to start")
        await pilot.press("ctrl+q")
    saved = HistoryStore().load(view.session.session_id).turns
    assert [t["role"] for t in saved] == ["user", "assistant"] and saved[-1]["note"] == "(cut off: the app quit)"


async def test_the_footer_names_keys_that_reach_the_app_and_quit():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        await pilot.pause(0.1)
        footer = {key.key: key.description for key in screen.query("FooterKey")}
        assert footer["ctrl+pagedown"] == "Next" and footer["ctrl+pageup"] == "Prev" and footer["ctrl+q"] == "Quit"
        assert "ctrl+tab" not in footer  # most terminals keep Ctrl+Tab: the footer names keys that arrive
        first = screen.active_view
        await pilot.press("ctrl+n")
        await pilot.press("ctrl+pageup")
        assert screen.active_view is first
        await pilot.press("ctrl+pagedown")
        assert screen.active_view is not first


async def test_the_model_picker_reloads_the_engine_and_sessions_keep_their_history(tmp_path):
    dirs = {name: save_byte_tokenizer(save_dir(tmp_path / name, tiny_model(seed))) for name, seed in
            (("tiny-a", 0), ("tiny-b", 1))}

    def factory_for_model(name: str):
        return lambda: Engine.from_config(EngineConfig(model=str(dirs[name]), num_pages=256, block_size=4),
                                          progress=False)

    app = ChatApp(factory_for_model("tiny-a"), model_label="tiny-a", factory_for_model=factory_for_model,
                  model_choices=lambda: [ModelChoice(name, "a tiny random model") for name in dirs],
                  defaults=SessionSettings("Be brief.", temperature=0.0, max_tokens=6))
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        await send(pilot, "hello")
        turns = list(screen.active_view.session.turns)
        first_engine = app.async_engine
        await pilot.press("ctrl+t")
        assert isinstance(app.screen, ModelsScreen)
        await pilot.press("down", "enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ChatScreen) and app.screen is not screen,
                       what="the chat screen on the new model")
        assert app.async_engine is not first_engine and first_engine.engine.model_name != app.async_engine.engine.model_name
        assert app.async_engine.engine.model_name == str(dirs["tiny-b"])
        assert "tiny-b" in str(app.screen.query_one(StatusBar).render())
        view = app.screen.active_view
        assert view.session.turns == turns and turns_shown(view)[0] == ("user", "hello")
        await send(pilot, "again")
        assert len(view.session.turns) == 4
    names = [choice.name for choice in available_models()]
    assert all(name in names for name in OFFLINE_MODELS)


async def test_the_model_picker_is_centred_and_shows_its_whole_header():
    """Like the F1 and F2 dialogs: in the middle of the screen, its header wrapped, never cut at the box's edge."""
    running = "/home/someone/models/converted/Qwen2.5-Coder-7B-Instruct-Q4_K_M-0123456789ab-native"
    app = ChatApp(tiny_engine, model_label=running, factory_for_model=lambda name: tiny_engine,
                  model_choices=lambda: [ModelChoice("tiny", "a tiny random model")])
    async with app.run_test(size=SIZE) as pilot:
        await started(pilot)
        await pilot.press("ctrl+t")
        await pilot.pause()
        assert isinstance(app.screen, ModelsScreen)
        box = app.screen.query_one("#models-box").region
        assert abs(box.x - (SIZE[0] - box.right)) <= 1 and abs(box.y - (SIZE[1] - box.bottom)) <= 1
        hint = app.screen.query_one("#models-hint")
        shown = "".join(strip.text for strip in hint.render_lines(Region(0, 0, *hint.size)))
        whole = f"Running: {running}. Enter switches; sessions keep their history."
        assert "".join(shown.split()) == "".join(whole.split())  # every character, wrapped over lines
        assert hint.region.right <= box.right


async def test_the_loading_screen_says_which_model_it_reopens():
    loading = threading.Event()
    note = "Reopening the model you used last (tiny); --model picks another."
    app = ChatApp(lambda: loading.wait(30) and tiny_engine(), model_label="tiny", load_note=note)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert str(app.screen.query_one("#loading-note", Static).render()) == note
        loading.set()
        await started(pilot)


async def test_switching_to_a_model_that_fails_to_load_shows_the_error_and_keeps_the_history(tmp_path):
    def factory_for_model(name: str):
        if name == "broken":
            return lambda: Engine.from_config(EngineConfig(model=str(tmp_path / "no-such-model")), progress=False)
        return tiny_engine

    app = ChatApp(tiny_engine, model_label="tiny", factory_for_model=factory_for_model,
                  model_choices=lambda: [ModelChoice("broken", "a model that is not there")],
                  defaults=SessionSettings("Be brief.", temperature=0.0, max_tokens=4))
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        await send(pilot, "hello")
        session_id = screen.active_view.session.session_id
        await pilot.press("ctrl+t", "enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorScreen), what="the error screen")
        assert "no such file or directory" in app.screen.error
        await pilot.press("q")
    assert app.return_code == 2
    assert [t["content"] for t in HistoryStore().load(session_id).turns][0] == "hello"


async def test_a_gpt_oss_reply_shows_its_analysis_apart_and_its_final_channel_as_the_reply(tmp_path):
    """harmony (gpt-oss): the UI reads the reply with the server's parser, its control tokens kept, so the
    analysis channel is the folded thinking and the final channel the reply."""
    from harmony_model import as_grammar, harmony_engine, harmony_model_dir

    model_dir = harmony_model_dir(tmp_path / "gpt-oss")
    reply = ("<|channel|>analysis<|message|>Greet them.<|end|>"
             "<|start|>assistant<|channel|>final<|message|>Hello!<|return|>")

    def factory():
        engine = harmony_engine(model_dir)
        add_request = engine.add_request
        engine.add_request = lambda prompt, params, *args, **kwargs: add_request(
            prompt, dataclasses.replace(params, grammar=as_grammar(reply), json_object=False), *args, **kwargs)
        return engine

    app = ChatApp(factory, model_label="tiny-gpt-oss",
                  defaults=SessionSettings("Be brief.", temperature=0.0, max_tokens=80))
    async with app.run_test(size=SIZE) as pilot:
        view = (await started(pilot)).active_view
        await send(pilot, "hi")
        thinking = view.query_one(".thinking", Collapsible)
        assert thinking.collapsed and str(thinking.query_one(".thinking-text", Static).render()) == "Greet them."
        assert last_reply(view) == "Hello!"
        assert view.session.turns[-1]["reasoning"] == "Greet them." and view.session.turns[-1]["content"] == "Hello!"


async def test_a_thinking_models_reply_shows_its_thinking_apart_folded_once_the_answer_starts():
    """A template that opens <think> in its generation prompt (Qwen3.5's): the reply's thinking is shown
    in its own fold, the answer in the reply, and the saved turn keeps both (history shows the fold)."""
    class ThinkingTokenizer(ByteTokenizer):
        chat_template_source = ByteTokenizer.chat_template_source + "<think>\n"

        def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
            return super().render_chat(messages, add_generation_prompt) + ("<think>\n" if add_generation_prompt else "")

    def factory():
        engine = tiny_engine()
        engine.tokenizer = ThinkingTokenizer()
        add_request = engine.add_request
        engine.add_request = lambda prompt, params, *args, **kwargs: add_request(
            prompt, dataclasses.replace(params, regex=r"Greet them\.\n</think>\n\nHello!"), *args, **kwargs)
        return engine

    app = ChatApp(factory, model_label="tiny", defaults=SessionSettings("Be brief.", temperature=0.0, max_tokens=40))
    async with app.run_test(size=SIZE) as pilot:
        view = (await started(pilot)).active_view
        await send(pilot, "hi")
        thinking = view.query_one(".thinking", Collapsible)
        assert thinking.collapsed and str(thinking.query_one(".thinking-text", Static).render()) == "Greet them."
        assert last_reply(view) == "Hello!"
        assert view.session.turns[-1]["reasoning"] == "Greet them." and view.session.turns[-1]["content"] == "Hello!"

    async with ChatApp(factory, model_label="tiny").run_test(size=SIZE) as pilot:  # restarted: the history
        view = (await started(pilot)).active_view
        thinking = view.query_one(".thinking", Collapsible)
        assert thinking.collapsed and str(thinking.query_one(".thinking-text", Static).render()) == "Greet them."
        assert turns_shown(view) == [("user", "hi"), ("assistant", "Hello!")]
