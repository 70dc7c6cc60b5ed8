"""F2 settings: every SamplingParams field a user touches goes from the screen into SessionSettings, into the
request the engine gets, into the history store and back; SamplingParams' own messages refuse bad values."""

from __future__ import annotations

import sqlite3
import string
from dataclasses import fields, replace

import pytest
from test_ui_app import make_app, notes, send, started, wait_for
from textual.widgets import Input, Switch, TextArea
from tiny_models import tiny_engine

from tinymlx.core.sampling_params import SamplingParams
from tinymlx_ui import ChatApp
from tinymlx_ui.screens.chat import PANEL_REDRAW_S, ChatScreen
from tinymlx_ui.screens.settings import NUMBER_FIELDS, SettingsScreen, format_stop, input_id, parse_stop
from tinymlx_ui.session import ChatSession, SessionSettings
from tinymlx_ui.store import _SETTINGS_COLUMNS, HistoryStore

SIZE = (120, 40)
FULL = SessionSettings(
    "Be terse.", temperature=0.8, max_tokens=20, json_output=False, top_p=0.9, top_k=40, min_p=0.05,
    repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=-0.5, seed=2**64 - 1,  # past SQLite's INTEGER
    stop=("###", "\n\n", "a,b", "it's"),
)


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_DATA", str(tmp_path / "data"))
    return tmp_path / "data"


def refusal(**params) -> str:
    """SamplingParams' own message for these values."""
    with pytest.raises(ValueError) as error:
        SamplingParams(**params)
    return str(error.value)


def record_requests(app) -> list[SamplingParams]:
    """The SamplingParams of every request the UI sends, as the engine receives them."""
    sent, generate = [], app.async_engine.generate

    def recording(prompt, params=None, **kwargs):
        sent.append(params)
        return generate(prompt, params, **kwargs)

    app.async_engine.generate = recording
    return sent


def error_text(app) -> str:
    return str(app.screen.query_one("#settings-error").render())


async def open_settings(pilot) -> SettingsScreen:
    await pilot.press("f2")
    assert isinstance(pilot.app.screen, SettingsScreen)
    return pilot.app.screen


def fill(screen: SettingsScreen, **texts: str) -> None:
    """Type into the screen's inputs by SessionSettings field name."""
    for field, text in texts.items():
        if field == "system_prompt":
            screen.query_one("#system-prompt-input", TextArea).text = text
        elif field == "json_output":
            screen.query_one("#json-output", Switch).value = text
        else:
            screen.query_one(f"#{input_id(field)}", Input).value = text


async def apply_settings(pilot, **texts) -> None:
    fill(await open_settings(pilot), **texts)
    await pilot.press("ctrl+s")
    assert isinstance(pilot.app.screen, ChatScreen), error_text(pilot.app)


def shown(screen: SettingsScreen) -> dict[str, str]:
    texts = {field: screen.query_one(f"#{input_id(field)}", Input).value for field, _, _ in NUMBER_FIELDS}
    return texts | {"stop": screen.query_one("#stop", Input).value,
                    "system_prompt": screen.query_one("#system-prompt-input", TextArea).text}


@pytest.mark.asyncio
async def test_every_field_goes_from_the_screen_into_the_request_and_the_store_and_back():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        view = screen.active_view
        sent = record_requests(app)
        await apply_settings(pilot, system_prompt="Be terse.", temperature="0.8", max_tokens="20",
                             seed=str(2**64 - 1), top_p="0.9", top_k="40", min_p="0.05", repetition_penalty="1.1",
                             presence_penalty=" 0.5 ", frequency_penalty="-0.5", stop=r"###, \n\n, a\,b ,it's")
        assert view.session.settings == FULL
        await send(pilot, "hi")
        assert sent == [FULL.sampling_params()]
        assert sent[0].seed == 2**64 - 1 and sent[0].stop == ("###", "\n\n", "a,b", "it's") and sent[0].top_k == 40
        # Reopened, the screen shows what was saved, and saving it unchanged changes nothing.
        settings_screen = await open_settings(pilot)
        assert shown(settings_screen) == {
            "temperature": "0.8", "max_tokens": "20", "seed": "18446744073709551615", "top_p": "0.9", "top_k": "40",
            "min_p": "0.05", "repetition_penalty": "1.1", "presence_penalty": "0.5", "frequency_penalty": "-0.5",
            "stop": r"###, \n\n, a\,b, it's", "system_prompt": "Be terse."}
        await pilot.press("ctrl+s")
        assert view.session.settings == FULL
        # An empty seed is no seed; the JSON switch still maps to json_object.
        await apply_settings(pilot, seed="", stop="", json_output=True)
        assert view.session.settings == replace(FULL, seed=None, stop=(), json_output=True)
        await send(pilot, "again")
        assert sent[-1].seed is None and sent[-1].stop == () and sent[-1].json_object
    store = HistoryStore()
    assert store.load(view.session.session_id).settings == view.session.settings


@pytest.mark.asyncio
async def test_a_stop_string_ends_the_reply():
    app = make_app(max_tokens=40)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        await send(pilot, "hello")
        first = screen.active_view
        full = first.session.turns[-1]["content"]
        assert notes(first) == ["(stopped at max tokens)"]
        # The tiny model's greedy reply is mostly control bytes: stop at its first plain character after the start.
        stop = next(ch for ch in full[1:] if ch in string.ascii_letters + string.digits + "?!.:;" and ch != full[0])
        await screen.action_new_session()
        await apply_settings(pilot, stop=f"zzz, {stop}")
        view = screen.active_view
        await send(pilot, "hello")
        assert view.session.turns[-1]["content"] == full[:full.index(stop)] != full
        assert notes(view) == []  # ended by the stop string, not by max tokens
        assert view.session.settings.stop == ("zzz", stop)


@pytest.mark.asyncio
async def test_a_seed_reproduces_a_sampled_reply():
    app = make_app(max_tokens=16)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        replies = []
        for seed in ("7", "7", "8"):
            if replies:
                await screen.action_new_session()
            await apply_settings(pilot, temperature="1.0", seed=seed)
            await send(pilot, "hi")
            replies.append(screen.active_view.session.turns[-1]["content"])
        assert replies[0] == replies[1] != replies[2]


INVALID = [  # (field, typed text, SamplingParams' values for it)
    ("temperature", "-1", {"temperature": -1.0}),
    ("temperature", "inf", {"temperature": float("inf")}),
    ("top_p", "0", {"top_p": 0.0}),
    ("top_k", "-2", {"top_k": -2}),
    ("min_p", "1.5", {"min_p": 1.5}),
    ("repetition_penalty", "0", {"repetition_penalty": 0.0}),
    ("presence_penalty", "2.5", {"presence_penalty": 2.5}),
    ("frequency_penalty", "-3", {"frequency_penalty": -3.0}),
    ("seed", "-1", {"seed": -1}),
    ("seed", str(2**64), {"seed": 2**64}),
    ("max_tokens", "0", {"max_tokens": 0}),
    ("stop", "a,,b", {"stop": ("a", "", "b")}),
    ("stop", "a,", {"stop": ("a", "")}),
]


@pytest.mark.asyncio
async def test_an_invalid_value_in_any_field_shows_sampling_params_message_and_saves_nothing():
    app = make_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        view = screen.active_view
        before = view.session.settings
        settings_screen = await open_settings(pilot)
        good = shown(settings_screen)
        for field, text, params in INVALID:
            fill(settings_screen, **{field: text})
            await pilot.press("ctrl+s")
            assert app.screen is settings_screen, f"{field}={text!r} was accepted"
            assert error_text(app) == refusal(**params)
            fill(settings_screen, **{field: good[field]})
        # Text that is no number at all is refused with the field's name.
        for field, _, kind in NUMBER_FIELDS:
            for text in ("abc", "-", "") if field != "seed" else ("abc", "1.5"):
                fill(settings_screen, **{field: text})
                await pilot.press("ctrl+s")
                assert app.screen is settings_screen, f"{field}={text!r} was accepted"
                what = "a number" if kind == "number" else "an integer"
                assert error_text(app) == f"{field} must be {what}, got {text!r}"
                fill(settings_screen, **{field: good[field]})
        await pilot.press("escape")
        assert app.screen is screen and view.session.settings == before
    assert HistoryStore().load(view.session.session_id).settings == before


@pytest.mark.asyncio
async def test_the_screen_fits_a_100x30_terminal():
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await started(pilot)
        screen = await open_settings(pilot)
        await pilot.pause()
        box = screen.query_one("#settings-box").content_region
        widgets = [*screen.query(Input), screen.query_one(TextArea), screen.query_one(Switch),
                   screen.query_one("#save"), screen.query_one("#cancel")]
        assert len(widgets) == 14
        for widget in widgets:
            assert widget.region.area and box.contains_region(widget.region), widget
        # Every label is shown whole in its input's border.
        for widget in screen.query(Input):
            assert len(widget.border_title) + 6 <= widget.region.width, widget.border_title
        fill(screen, stop="a,")
        await pilot.press("ctrl+s")
        await pilot.pause()
        error = screen.query_one("#settings-error")
        assert error.region.area and box.contains_region(error.region)


@pytest.mark.asyncio
async def test_f2_turns_the_engines_disk_cache_off_and_on(tmp_path):
    """Engine-wide, beside the buttons: shown only when the engine has a disk tier; the engine panel says so
    (and the status bar, where the terminal is wide enough: at 100 columns it keeps the KV figures first)."""
    app = ChatApp(lambda: tiny_engine(disk_cache_dir=str(tmp_path / "disk")), model_label="tiny",
                  defaults=SessionSettings(temperature=0.0, max_tokens=4))
    async with app.run_test(size=(100, 30)) as pilot:
        await started(pilot)
        tier = app.async_engine.engine.disk_tier
        screen = await open_settings(pilot)
        switch = screen.query_one("#disk-cache", Switch)
        assert switch.value and screen.query_one("#settings-box").content_region.contains_region(switch.region)
        switch.value = False
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: not tier.is_enabled, what="the tier turned off")
        await send(pilot, "hi")
        await wait_for(pilot, lambda: "disk cache off" in str(app.screen.query_one("#counters").render()),
                       timeout=2 * PANEL_REDRAW_S + 2, what="the panel to say the disk cache is off")
        assert tier.writer.num_files_written == 0  # off: nothing saved
        screen = await open_settings(pilot)
        assert not screen.query_one("#disk-cache", Switch).value
        screen.query_one("#disk-cache", Switch).value = True
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: tier.is_enabled, what="the tier back on")


def test_stop_strings_are_one_line_of_comma_separated_text():
    assert parse_stop("") == () and parse_stop("  ") == ()
    assert parse_stop(r"###,  User: , \n\n") == ("###", "User:", "\n\n")
    assert parse_stop(r"a\,b, c\\, \t, \x") == ("a,b", "c\\", "\t", r"\x")
    assert parse_stop("a,,b") == ("a", "", "b")  # refused by SamplingParams, not dropped here
    for stop in [(), ("###",), ("a,b", "\n", "\\", "c\\,", "\\n", "x\ty", "it's")]:
        assert parse_stop(format_stop(stop)) == stop


def test_the_store_has_a_column_for_every_setting_and_keeps_each(tmp_path):
    assert list(_SETTINGS_COLUMNS) == [f.name for f in fields(SessionSettings)]
    store = HistoryStore(tmp_path / "h.sqlite3")
    session = store.create_session(FULL)
    other = store.create_session(SessionSettings())
    store.close()
    store = HistoryStore(tmp_path / "h.sqlite3")
    assert store.load(session.session_id).settings == FULL
    assert store.load(other.session_id).settings == SessionSettings()
    changed = SessionSettings("", 0.0, 1, True, 0.5, -1, 1.0, 3.0, -2.0, 2.0, 0, ("\u00e9t\u00e9", "'; DROP"))
    store.save_session(ChatSession(session.session_id, "t", changed))
    store.close()
    assert HistoryStore(tmp_path / "h.sqlite3").load(session.session_id).settings == changed


OLD_SCHEMAS = {
    "before JSON output": "",
    "with JSON output": "json_output INTEGER NOT NULL DEFAULT 0,",
}


@pytest.mark.parametrize("extra", OLD_SCHEMAS.values(), ids=OLD_SCHEMAS.keys())
def test_an_older_history_opens_with_every_new_setting_at_its_default(tmp_path, extra):
    db = sqlite3.connect(tmp_path / "old.sqlite3")
    db.executescript(f"""
        CREATE TABLE sessions (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL, system_prompt TEXT NOT NULL,
            temperature REAL NOT NULL, max_tokens INTEGER NOT NULL, {extra} is_open INTEGER NOT NULL DEFAULT 1,
            updated REAL NOT NULL);
        CREATE TABLE turns (id INTEGER PRIMARY KEY AUTOINCREMENT,
            session_id INTEGER NOT NULL REFERENCES sessions(id) ON DELETE CASCADE,
            role TEXT NOT NULL, content TEXT NOT NULL);
        INSERT INTO sessions (title, system_prompt, temperature, max_tokens, updated) VALUES ('old', 'hi', 0.5, 9, 0);
        INSERT INTO turns (session_id, role, content) VALUES (1, 'user', 'hello');
    """)
    db.commit()
    db.close()
    store = HistoryStore(tmp_path / "old.sqlite3")
    old = store.load(1)
    assert old.settings == SessionSettings("hi", 0.5, 9) and old.turns == [{"role": "user", "content": "hello"}]
    assert old.settings.sampling_params() == SamplingParams(temperature=0.5, max_tokens=9)
    store.save_session(ChatSession(1, "old", FULL))
    new = store.create_session(FULL)
    store.close()
    store = HistoryStore(tmp_path / "old.sqlite3")  # opening a migrated history migrates nothing more
    assert store.load(1).settings == FULL and store.load(new.session_id).settings == FULL
