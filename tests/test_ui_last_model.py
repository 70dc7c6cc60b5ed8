"""`tinymlx chat` without --model reopens the model the chat ran last, or says on the loading screen why not."""

from __future__ import annotations

import shutil

import pytest
from test_ui_app import SIZE, started, wait_for
from tiny_models import save_byte_tokenizer, save_dir, tiny_model

from tinymlx_ui import ChatApp, last_model, run_chat
from tinymlx_ui.screens.chat import ChatScreen


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_DATA", str(tmp_path / "data"))  # where the last model is kept


def test_a_restart_reopens_the_model_switched_to_last_or_says_why_not(tmp_path, monkeypatch):
    """`tinymlx chat` without --model: the model picked last, or the default with the reason on the loading screen."""
    dirs = {name: save_byte_tokenizer(save_dir(tmp_path / name, tiny_model(seed))) for name, seed in
            (("tiny-a", 0), ("tiny-b", 1))}
    loaded: list[str] = []

    async def switch_to_b_and_quit(pilot):
        await started(pilot)
        pilot.app._switch_model(str(dirs["tiny-b"]))  # what Enter on it in the picker (Ctrl+T) does
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, ChatScreen) and pilot.app.async_engine, what="tiny-b")
        loaded.append(pilot.app.async_engine.engine.model_name)
        await pilot.press("ctrl+q")

    async def quit_when_started(pilot):
        await started(pilot)
        loaded.append(pilot.app.async_engine.engine.model_name)
        await pilot.press("ctrl+q")

    script = [switch_to_b_and_quit]
    run = ChatApp.run
    monkeypatch.setattr(ChatApp, "run", lambda self: run(self, headless=True, size=SIZE, auto_pilot=script[0]))
    assert run_chat(str(dirs["tiny-a"]), num_pages=64, block_size=4) == 0
    script[0] = quit_when_started
    assert run_chat(None, num_pages=64, block_size=4) == 0  # restarted without --model
    assert loaded == [str(dirs["tiny-b"])] * 2
    assert last_model.recall() == (str(dirs["tiny-b"]), f"Reopening the model you used last ({dirs['tiny-b']}); "
                                                        "--model picks another.")
    shutil.rmtree(dirs["tiny-b"])
    assert last_model.recall() == (None, f"The model you used last, {dirs['tiny-b']}, is gone; starting the default.")


def test_a_relative_path_is_remembered_whole(tmp_path, monkeypatch):
    (tmp_path / "models" / "mine").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    last_model.remember("models/mine")
    monkeypatch.chdir("/")
    assert last_model.recall().name == str(tmp_path / "models" / "mine")
