"""Images in the chat UI, headless: attached by the command and by a pasted path into a session running a
tiny random Qwen2.5-VL, shown as chips with their token counts, sent as content parts, stored and reloaded,
resent as the same bytes (a prefix hit); a bad file, the engine's limits, and a model that reads text only."""

from __future__ import annotations

import re
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from textual import events
from textual.widgets import Input
from tiny_models import tiny_engine
from vision_checkpoints import drawn_image, png_bytes, qwen2_5_vl_checkpoint

from tinymlx.core.config import EngineConfig
from tinymlx.engine.engine import Engine
from tinymlx.text.tokenizer import Tokenizer
from tinymlx_ui import ChatApp
from tinymlx_ui.attachments import Attachment, over_limit, pasted_image_paths, paths_in
from tinymlx_ui.screens.attach import AttachScreen
from tinymlx_ui.screens.chat import ChatScreen
from tinymlx_ui.session import ChatSession, SessionSettings
from tinymlx_ui.store import HistoryStore
from tinymlx_ui.widgets import status_bar
from tinymlx_ui.widgets.block_map import BlockMap
from tinymlx_ui.widgets.image_chips import AttachmentChip, ImageChip, SentImages
from tinymlx_ui.widgets.prompt_input import PromptInput

SIZE = (120, 40)
BLOCK_SIZE = 8


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYMLX_DATA", str(tmp_path / "data"))
    return tmp_path / "data"


@pytest.fixture(scope="module")
def vl_checkpoint(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")  # writes the checkpoint
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    qwen2_5_vl_checkpoint(path)
    return path


@pytest.fixture
def picture(tmp_path) -> Path:
    """A PNG with a space in its name, as screenshots are named."""
    path = tmp_path / "my screenshot.png"
    path.write_bytes(png_bytes(drawn_image(100, 80)))
    return path


def vl_app(checkpoint: Path, **config) -> ChatApp:
    def factory() -> Engine:
        return Engine.load(checkpoint, Tokenizer.from_dir(checkpoint), EngineConfig(block_size=BLOCK_SIZE, **config))

    return ChatApp(factory, model_label="tiny-qwen2.5-vl",
                   defaults=SessionSettings("Be brief.", temperature=0.0, max_tokens=8))


def text_app() -> ChatApp:
    return ChatApp(tiny_engine, model_label="tiny", defaults=SessionSettings("Be brief.", temperature=0.0, max_tokens=8))


def spy_on_prompts(app: ChatApp) -> list:
    """Every prompt the chat hands the engine."""
    prompts, generate = [], app.async_engine.generate

    def recording(prompt, *args, **kwargs):
        prompts.append(prompt)
        return generate(prompt, *args, **kwargs)

    app.async_engine.generate = recording
    return prompts


async def wait_for(pilot, condition, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await pilot.pause(0.05)


async def started(pilot) -> ChatScreen:
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, ChatScreen), what="the chat screen")
    await pilot.pause()
    return pilot.app.screen


async def attach_by_command(pilot, path: Path) -> None:
    """Ctrl+F, the path (quoted, as a shell would take it), Enter; then wait for a chip or a notification."""
    view, app = pilot.app.screen.active_view, pilot.app
    num_before = len(view.attachments), len(app._notifications)
    await pilot.press("ctrl+f")
    assert isinstance(app.screen, AttachScreen)
    app.screen.query_one(Input).value = f'"{path}"'
    await pilot.press("enter")
    await wait_for(pilot, lambda: (len(view.attachments), len(app._notifications)) != num_before, what="the image")


async def send(pilot, text: str) -> None:
    view = pilot.app.screen.active_view
    await pilot.press(*text, "enter")
    await wait_for(pilot, lambda: not view.is_replying, what="the reply")


def chips(widget, kind=ImageChip) -> list[str]:
    return [str(chip.render()) for chip in widget.query(kind)]


def cached_of(stats: str) -> tuple[int, int]:
    cached, total = re.search(r"(\d+)/(\d+) prompt tokens from cache", stats).groups()
    return int(cached), int(total)


@pytest.mark.asyncio
async def test_an_image_attached_by_command_is_sent_stored_reloaded_and_resent_as_a_prefix_hit(vl_checkpoint, picture):
    data = picture.read_bytes()
    app = vl_app(vl_checkpoint)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        prompts = spy_on_prompts(app)
        engine = app.async_engine.engine
        num_tokens = engine.images.num_tokens(data)
        assert num_tokens > 0
        await attach_by_command(pilot, picture)
        view = screen.active_view
        assert chips(view, AttachmentChip) == [f"▣ my screenshot.png · 100×80 · {num_tokens} tokens"]

        await send(pilot, "what is this?")
        assert prompts[-1][-1] == {"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                              {"type": "image", "image": data}]}
        assert view.session.turns[-1]["role"] == "assistant" and view.session.turns[-1]["content"]
        assert not view.attachments and not view.query(AttachmentChip)  # the tray empties when the message goes
        assert chips(view.query_one(SentImages)) == [f"▣ my screenshot.png · 100×80 · {num_tokens} tokens"]
        assert engine.stats().images.num_encoded_images == 1
        first_cached, first_prompt = cached_of(view.session.turns[-1]["stats"])
        assert first_cached == 0

        # Closed and reopened: the session comes back from the store, its image with it.
        session_id = view.session.session_id
        await screen.action_close_session()
        await screen._reopen(session_id)
        await pilot.pause()
        view = screen.active_view
        assert view.session.session_id == session_id and view.session.turns[0]["images"][0].data == data
        assert chips(view.query_one(SentImages)) == [f"▣ my screenshot.png · 100×80 · {num_tokens} tokens"]

        await send(pilot, "and now?")
        assert prompts[-1][1]["content"][1] == {"type": "image", "image": data}  # the same bytes again
        assert prompts[-1][-1] == {"role": "user", "content": "and now?"}  # a turn without images: plain text
        cached, _ = cached_of(view.session.turns[-1]["stats"])
        # The whole first prompt but its last partial block, which lies after the image ("\n<assistant>").
        assert cached >= first_prompt - BLOCK_SIZE + 1
        assert engine.stats().prefix_hit_rate > 0
        assert engine.stats().images.num_encoded_images == 1  # served from the cache, not encoded again
        app.async_engine.check()

    # A new start over the same history shows the chips.
    app = vl_app(vl_checkpoint)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        assert chips(screen._views[session_id].query_one(SentImages)) == [
            f"▣ my screenshot.png · 100×80 · {num_tokens} tokens"]


@pytest.mark.asyncio
async def test_a_pasted_path_attaches_the_image_and_a_chip_can_be_removed(vl_checkpoint, picture, tmp_path):
    other = tmp_path / "second.jpg"
    drawn_image(60, 90, seed=2).save(other, format="JPEG")
    app = vl_app(vl_checkpoint)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        prompts = spy_on_prompts(app)
        view = screen.active_view
        prompt = view.query_one(PromptInput)
        # Two files dragged in at once, as a terminal pastes them: quoted, and as a file:// URL. The App hands a
        # paste to the focused widget, as it does the terminal's.
        app.post_message(events.Paste(f"'{picture}' file://{other} "))
        await wait_for(pilot, lambda: len(view.attachments) == 2, what="two chips")
        assert prompt.text == ""  # attached, not typed
        labels = chips(view, AttachmentChip)
        assert labels[0].startswith("▣ my screenshot.png · 100×80 · ")
        assert labels[1].startswith("▣ second.jpg · 60×90 · ")

        # Shift+Tab from the prompt reaches the last chip; Delete takes it off, and the prompt has focus again.
        await pilot.press("shift+tab")
        assert isinstance(app.focused, AttachmentChip) and app.focused.attachment.name == "second.jpg"
        await pilot.press("delete")
        await pilot.pause()
        assert [a.name for a in view.attachments] == ["my screenshot.png"] and app.focused is prompt

        app.post_message(events.Paste("just some text"))  # not a file: pasted as text
        await pilot.pause()
        assert prompt.text == "just some text" and len(view.attachments) == 1
        await pilot.press("enter")
        await wait_for(pilot, lambda: not view.is_replying and len(view.session.turns) == 2, what="the reply")
        assert prompts[-1][-1]["content"] == [{"type": "text", "text": "just some text"},
                                              {"type": "image", "image": picture.read_bytes()}]
        assert app.async_engine.engine.stats().images.num_encoded_images == 1
        app.async_engine.check()


@pytest.mark.asyncio
async def test_a_bad_image_or_one_too_many_is_refused_with_a_notification(vl_checkpoint, picture, tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(picture.read_bytes()[:200])  # truncated
    app = vl_app(vl_checkpoint, max_images_per_request=1)
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        view = screen.active_view
        await pilot.press(*"keep me")
        await attach_by_command(pilot, broken)
        assert not view.attachments and not view.query(AttachmentChip)
        assert view.query_one(PromptInput).text == "keep me"  # nothing lost
        assert any("broken.png" in n.message and "corrupt" in n.message for n in app._notifications)

        await attach_by_command(pilot, tmp_path / "missing.png")
        assert any("no such file" in n.message for n in app._notifications)

        await attach_by_command(pilot, picture)
        assert len(view.attachments) == 1
        app.post_message(events.Paste(str(picture)))
        await wait_for(pilot, lambda: any("at most 1" in n.message for n in app._notifications), what="the limit")
        assert len(view.attachments) == 1 and view.query_one(PromptInput).text == "keep me"


@pytest.mark.asyncio
async def test_a_text_only_model_shows_the_note_chip_and_gets_the_note(picture):
    app = text_app()
    async with app.run_test(size=SIZE) as pilot:
        screen = await started(pilot)
        view = screen.active_view
        await attach_by_command(pilot, picture)
        assert chips(view, AttachmentChip) == [
            "▣ my screenshot.png · 100×80 · sent as a note (this model reads text only)"]
        await send(pilot, "look")
        assert app.async_engine.engine.images.num_omitted_images == 1
        assert view.session.turns[-1]["role"] == "assistant"
        assert chips(view.query_one(SentImages)) == [
            "▣ my screenshot.png · 100×80 · sent as a note (this model reads text only)"]

        await pilot.press("ctrl+l")  # edit and resend: the text and the image come back to the prompt
        await pilot.pause()
        assert view.query_one(PromptInput).text == "look"
        assert [a.name for a in view.attachments] == ["my screenshot.png"] and not view.query(SentImages)


def test_pasted_paths_as_terminals_paste_dragged_files(tmp_path, picture):
    escaped = str(picture).replace(" ", "\\ ")
    for pasted in (str(picture), f"'{picture}'", f'"{picture}" ', escaped, f"file://{str(picture).replace(' ', '%20')}"):
        assert pasted_image_paths(pasted) == [picture], pasted
    text_file = tmp_path / "notes.txt"
    text_file.write_text("hi")
    for pasted in ("hello world", str(text_file), str(tmp_path / "gone.png"), f"{picture} and more", "", "x" * 10_000):
        assert pasted_image_paths(pasted) == [], pasted
    assert paths_in("~/nothing here.png") == [Path("~/nothing here.png").expanduser()]  # one path to report


def test_the_engine_limits_count_every_image_of_the_conversation():
    config = EngineConfig(max_images_per_request=2, max_image_bytes=100)
    sees, blind = SimpleNamespace(sees_images=True, config=config), SimpleNamespace(sees_images=False, config=config)
    image = Attachment("a.png", b"x" * 40, 1, 1, 4)
    assert over_limit([image], image, sees) is None
    assert "at most 2 images" in over_limit([image, image], image, sees)
    assert "max-image-bytes" in over_limit([image], Attachment("b.png", b"x" * 61, 1, 1, 4), sees)
    assert over_limit([image] * 5, image, blind) is None  # notes have no limit


def test_the_store_keeps_images_and_opens_an_older_history(data_dir):
    data_dir.mkdir(parents=True)
    path = data_dir / "history.sqlite3"
    with sqlite3.connect(path) as db:  # a history written before images: no turn_images table
        db.executescript("CREATE TABLE sessions (id INTEGER PRIMARY KEY AUTOINCREMENT, title TEXT NOT NULL, "
                         "is_open INTEGER NOT NULL DEFAULT 1, updated REAL NOT NULL);"
                         "CREATE TABLE turns (id INTEGER PRIMARY KEY AUTOINCREMENT, session_id INTEGER NOT NULL, "
                         "role TEXT NOT NULL, content TEXT NOT NULL);"
                         "INSERT INTO sessions (title, updated) VALUES ('old', 0);"
                         "INSERT INTO turns (session_id, role, content) VALUES (1, 'user', 'hello');")
    store = HistoryStore(path)
    assert store.load(1).turns == [{"role": "user", "content": "hello"}]
    image = Attachment("a.png", png_bytes(drawn_image(20, 10)), 20, 10, 7)
    store.add_turns(1, [{"role": "assistant", "content": "hi"},
                        {"role": "user", "content": "see", "images": (image, image)}])
    store.close()
    store = HistoryStore(path)  # opening again adds nothing twice
    turns = store.load(1).turns
    assert turns[2]["images"] == (Attachment("a.png", image.data, 20, 10),) * 2  # token counts: measured on open
    assert ChatSession(1, turns=turns[:2]).prompt_messages() == [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    store.delete_last_turns(1, 1)
    assert store._db.execute("SELECT COUNT(*) FROM turn_images").fetchone() == (0,)  # gone with their turn
    store.close()


def test_chips_in_a_sent_message_and_in_the_prompt_snapshot(snap_compare, monkeypatch):
    """A stored message with an image, and two images attached to the next, the last chip focused."""
    monkeypatch.setattr(status_bar, "process_memory", lambda: ("process", 512 << 20))  # live: would differ each run
    data = png_bytes(drawn_image(100, 80))
    store = HistoryStore()
    session = store.create_session(SessionSettings())
    session.title = "a screenshot"
    store.save_session(session)
    store.add_turns(session.session_id, [
        {"role": "user", "content": "What is in this picture?",
         "images": (Attachment("screenshot 2026-01-02.png", data, 100, 80),)},
        {"role": "assistant", "content": "A green circle on a gradient."}])
    store.close()

    async def attach_two(pilot) -> None:
        await wait_for(pilot, lambda: isinstance(pilot.app.screen, ChatScreen) and pilot.app.screen.query_one(BlockMap).data,
                       what="the block map's first figures")
        view = pilot.app.screen.active_view
        view.query_one(PromptInput).cursor_blink = False
        view.set_attachments((Attachment("cat.png", data, 100, 80, 12), Attachment("dog.jpg", data, 640, 480, 99)))
        await pilot.pause(0.1)
        await pilot.press("shift+tab")
        await pilot.pause(0.3)

    assert snap_compare(ChatApp(tiny_engine, model_label="tiny"), terminal_size=SIZE, run_before=attach_two)
