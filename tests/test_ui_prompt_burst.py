"""Keys that reach the chat in one burst (fast typing, an IME, a terminal without bracketed paste,
`tmux send-keys 'text' Enter`) are taken in the order they came: each message is sent whole (issue #40)."""

from __future__ import annotations

import time

import pytest
from test_ui_app import SIZE, make_app, started
from textual import events
from textual.keys import _character_to_key

from tinymlx_ui.widgets.prompt_input import PromptInput
from tinymlx_ui.widgets.session_view import SessionView

pytestmark = pytest.mark.asyncio

PALINDROME = "Write a Python function that checks whether a string is a palindrome."
# The characters a terminal sends for the named keys these tests press.
KEY_CHARACTERS = {"enter": "\r", "ctrl+j": "\n", "backspace": "\x7f"}


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_DATA", str(tmp_path / "data"))
    return tmp_path / "data"


def burst(app, *keys: str) -> None:
    """Queue every key on the app at once, as the terminal driver does with input it read in one go.
    Pilot's press waits for the app to go idle after each key, which hides the reordering."""
    for key in keys:
        if len(key) == 1:
            app.post_message(events.Key(_character_to_key(key), key))
        else:
            app.post_message(events.Key(key, KEY_CHARACTERS.get(key)))


def user_turns(view: SessionView) -> list[str]:
    return [turn["content"] for turn in view.session.turns if turn["role"] == "user"]


def sent_and_left(view: SessionView) -> tuple[list[str], str]:
    """The user turns sent, and the text left in the box: what a failure shows."""
    return user_turns(view), view.query_one(PromptInput).text


async def settled(pilot, view: SessionView, num_user_turns: int, timeout: float = 15.0) -> None:
    """Wait (at most `timeout`) for `num_user_turns` user turns and their reply to end; the test then
    compares what was sent and what was left, which says more than a timeout would."""
    deadline = time.monotonic() + timeout
    while (len(user_turns(view)) < num_user_turns or view.is_replying) and time.monotonic() < deadline:
        await pilot.pause(0.05)
    await pilot.pause()


async def test_a_message_and_enter_in_one_burst_is_sent_whole():
    app = make_app(max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        view = (await started(pilot)).active_view
        burst(app, *PALINDROME, "enter")
        await settled(pilot, view, 1)
        assert sent_and_left(view) == ([PALINDROME], "")


async def test_two_messages_in_one_burst_are_both_kept_whole_and_in_order():
    first, second = PALINDROME, "And now one that reverses a list, please."
    app = make_app(max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        view = (await started(pilot)).active_view
        burst(app, *first, "enter", *second, "enter")
        await settled(pilot, view, 1)
        if len(user_turns(view)) < 2:
            # One turn at a time: the second Enter came while the first reply streamed, so the second
            # message waits in the box, whole, for the next Enter.
            assert sent_and_left(view) == ([first], second)
            burst(app, "enter")
            await settled(pilot, view, 2)
        assert sent_and_left(view) == ([first, second], "")


async def test_editing_keys_in_a_burst_keep_their_place():
    app = make_app(max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        view = (await started(pilot)).active_view
        burst(app, *"line one", "ctrl+j", *"line twx", "backspace", "o", "enter")
        await settled(pilot, view, 1)
        assert sent_and_left(view) == (["line one\nline two"], "")


async def test_a_message_sent_just_before_ctrl_r_is_neither_lost_nor_answered_beside_the_retry():
    """Ctrl+R is a priority key: it runs as it reaches the App, ahead of the Enter still queued in the prompt."""
    app = make_app(max_tokens=4)
    async with app.run_test(size=SIZE) as pilot:
        view = (await started(pilot)).active_view
        burst(app, *"first", "enter")
        await settled(pilot, view, 1)
        burst(app, *"next", "enter", "ctrl+r")
        await settled(pilot, view, 1)
        if sent_and_left(view) == (["first"], "next"):  # retried first; the message waits in the box
            burst(app, "enter")
            await settled(pilot, view, 2)
        assert sent_and_left(view) == (["first", "next"], "")
        assert [turn["role"] for turn in view.session.turns] == ["user", "assistant"] * 2
