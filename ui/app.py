"""ChatApp: load the model off the UI thread, showing each stage, then chat; `run_chat` is what `tinymlx chat` calls."""

from __future__ import annotations

import dataclasses
import gc
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import mlx.core as mx
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from tinymlx import STARTED_AT
from tinymlx.core.config import EngineConfig, takes_options
from tinymlx.engine.async_engine import AsyncEngine
from tinymlx.engine.engine import Engine
from tinymlx.loader import ModelLoadError
from tinymlx.loader.offline import DEFAULT_MODEL
from tinymlx.loader.progress import LoadProgress
from tinymlx.models import resolve_dtype
from tinymlx.turns.reply_format import ReplyFormat
from tinymlx_ui import last_model
from tinymlx_ui.messages import EngineFailed, EngineReady, LoadProgressed
from tinymlx_ui.screens.chat import ChatScreen
from tinymlx_ui.screens.error import ErrorScreen
from tinymlx_ui.screens.help import HelpScreen
from tinymlx_ui.screens.loading import LoadingScreen
from tinymlx_ui.screens.models import ModelChoice, ModelsScreen, available_models
from tinymlx_ui.session import SessionSettings
from tinymlx_ui.store import HistoryStore
from tinymlx_ui.widgets.image_chips import AttachmentChip
from tinymlx_ui.widgets.prompt_input import PromptInput
from tinymlx_ui.widgets.status_bar import EngineInfo

LOAD_FAILED_EXIT_CODE = 2  # what the other commands return for a model that does not load


class ChatApp(App):
    CSS_PATH = Path(__file__).with_name("app.tcss")  # absolute: Textual resolves relative to a subclass's file
    TITLE = "tinymlx chat"
    BINDINGS = [
        Binding("f1,question_mark", "help", "Help", tooltip="This help"),
        Binding("ctrl+q", "quit", "Quit", tooltip="Quit (a reply in flight is kept, marked as cut off)",
                priority=True),
    ]
    # Taller terminals get taller graphs (see app.tcss).
    VERTICAL_BREAKPOINTS = [(0, "-short"), (40, "-tall")]

    def __init__(self, engine_factory: Callable[[], Engine], *, model_label: str = DEFAULT_MODEL,
                 defaults: SessionSettings | None = None,
                 factory_for_model: Callable[[str], Callable[[], Engine]] | None = None,
                 model_choices: Callable[[], list[ModelChoice]] = available_models,
                 started_at: float | None = None, load_note: str = "") -> None:
        """`factory_for_model(name)`: the engine factory for another model (the model picker), and the
        chat remembers the model it ran last; None: the picker is off. `started_at`: when start-up began
        (time.monotonic()), and `load_note` why this model, for the loading screen."""
        super().__init__()
        self._started_at, self._load_note = started_at, load_note
        self._engine_factory, self._model_label = engine_factory, model_label
        self._factory_for_model, self._model_choices = factory_for_model, model_choices
        self._defaults = defaults or SessionSettings()
        self.async_engine: AsyncEngine | None = None
        self.load_error: str | None = None

    def on_mount(self) -> None:
        self.push_screen(LoadingScreen(self._model_label, self._started_at, self._load_note))
        self._start_loading()

    def _start_loading(self) -> None:
        # A daemon thread, not a worker: quitting during a long first download must not wait for it.
        threading.Thread(target=self._load, name="tinymlx-ui-load", daemon=True).start()

    def action_pick_model(self) -> None:
        if self._factory_for_model is None:
            self.notify("This chat was started with a fixed engine: no other model to switch to.",
                        severity="warning")
            return
        self.push_screen(ModelsScreen(self._model_choices(), self._model_label), self._switch_model)

    def _switch_model(self, name: str | None) -> None:
        """Reload the engine with `name`: the chat screen goes (replies in flight are kept, marked cut
        off), the loading screen shows the stages, and the new chat screen reopens the open sessions."""
        if name is None or name == self._model_label:
            return
        self._engine_factory, self._model_label = self._factory_for_model(name), name
        old, self.async_engine = self.async_engine, None
        gc.unfreeze()  # the old engine's objects may be collected again
        self.switch_screen(LoadingScreen(name))
        if old is not None:
            old.shutdown()
        self._start_loading()

    def report_progress(self, progress: LoadProgress) -> None:
        """A loader's progress callback: safe from any thread, coalesced (see LoadProgressed)."""
        self.post_message(LoadProgressed(progress))

    def on_load_progressed(self, message: LoadProgressed) -> None:
        if isinstance(self.screen, LoadingScreen):
            self.screen.show_progress(message.progress)

    def _load(self) -> None:
        try:
            engine = self._engine_factory()
        except ModelLoadError as error:
            self.post_message(EngineFailed(str(error)))
        except Exception as error:  # noqa: BLE001 - any failure to load is shown on the error screen
            self.post_message(EngineFailed(f"{type(error).__name__}: {error}"))
        else:
            self.post_message(EngineReady(engine))

    def on_engine_ready(self, message: EngineReady) -> None:
        engine = message.engine
        if self._factory_for_model is not None:  # the real chat, not a fixed engine
            last_model.remember(self._model_label)
        stats = engine.stats()
        info = EngineInfo(
            engine.model_name, mx.default_device().type.name, resolve_dtype(engine.config.dtype),
            stats.num_pages_total, engine.config.block_size, engine.config.tensor_parallel_size,
            engine.config.pipeline_parallel_size,
            weights_bytes=stats.weights_bytes + stats.draft_weights_bytes,
            kv_cache_bytes=stats.pools_bytes, kv_cache_bytes_budget=stats.pools_bytes_budget,
            kv_groups=tuple(group.label for group in stats.kv_groups),
            has_chat_template=engine.tokenizer.has_chat_template,
            reply_format=ReplyFormat.of_template(engine.tokenizer.chat_template_source),
        )
        self.async_engine = AsyncEngine(engine)
        self.switch_screen(ChatScreen(self.async_engine, HistoryStore(), info, self._defaults))
        # The engine's objects (model, tokenizer, pools) live as long as it does: out of the collector's
        # passes, which otherwise walk them all each time the UI's garbage reaches the oldest generation
        # (70 ms a pass here, holding the GIL the step loop needs; twice a two-reply benchmark run).
        gc.freeze()

    def on_engine_failed(self, message: EngineFailed) -> None:
        self.load_error = message.error
        if self._factory_for_model is not None and last_model.recall().name == self._model_label:
            last_model.forget()  # the next start falls back to the default, not to this failure again
        self.switch_screen(ErrorScreen(message.error))

    async def action_quit(self) -> None:
        # After a failed load every way out (q, Esc, ctrl+q, the palette) exits non-zero.
        self.exit(return_code=0 if self.load_error is None else LOAD_FAILED_EXIT_CODE)

    def on_unmount(self) -> None:
        gc.unfreeze()
        if self.async_engine is not None:
            self.async_engine.shutdown()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.key_rows()))

    def key_rows(self) -> list[tuple[str, str]]:
        bindings = [*PromptInput.BINDINGS, *ChatScreen.BINDINGS, *AttachmentChip.BINDINGS, *self.BINDINGS,
                    Binding("ctrl+p", "command_palette", "Command palette")]
        return [(" / ".join(self.get_key_display(Binding(key, "")) for key in b.key.split(",")),
                 b.tooltip or b.description) for b in bindings]

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Help", "Show every key", self.action_help)
        if isinstance(screen, ChatScreen):
            yield SystemCommand("New session", "Open a new chat session", screen.action_new_session)
            yield SystemCommand("Close session", "Close the current session (its history is kept)",
                                screen.action_close_session)
            yield SystemCommand("Reopen a session", "Pick a saved session to reopen", screen.action_open_session)
            yield SystemCommand("Session settings", "System prompt, sampling, stop strings, JSON output", screen.action_settings)
            yield SystemCommand("Attach image", "Attach an image file to the message (a path; or drag the file in)",
                                screen.action_attach_image)
            yield SystemCommand("Cancel reply", "Stop the current session's reply", screen.action_cancel_reply)
            yield SystemCommand("Toggle engine panel", "Show or hide the engine panel", screen.action_toggle_panel)
            yield SystemCommand("Block map: zoom or whole pool", "The blocks in use and cached, or every block",
                                screen.action_toggle_block_map)
            yield SystemCommand("Switch model", "Reload the engine with another model", self.action_pick_model)
            yield SystemCommand("Regenerate", "Regenerate the last reply", screen.action_regenerate)
            yield SystemCommand("Edit last message", "Edit and resend your last message", screen.action_edit_last)
            yield SystemCommand("Copy reply", "Copy the last reply to the clipboard", screen.action_copy_reply)
            yield SystemCommand("Copy code block", "Copy the last reply's last code block", screen.action_copy_code)
            yield SystemCommand("Export as Markdown", "Write the session to a Markdown file", screen.action_export)


@takes_options
def run_chat(model: str | None = None, **options) -> int:
    """Run `tinymlx chat`; return the exit code (LOAD_FAILED_EXIT_CODE when the model did not load).
    `options`: EngineConfig's (LLM's); bad ones raise TypeError or ValueError here, before the UI starts.
    `disk_cache_dir`: the prefix cache's disk tier (the CLI passes the chat's default one; F2 turns it off
    and on)."""
    # Without --model, the model the chat ran last (or the default, saying why not that one).
    last = last_model.recall() if model is None else last_model.LastModel(model, "")
    model = last.name
    config = EngineConfig.from_options(model=model, **options)
    # The factory runs on the loading thread, after `app` is bound: it reports to the app's loading screen.
    def factory_for_model(name: str | None) -> Callable[[], Engine]:
        chosen = dataclasses.replace(config, model=name)
        return lambda: Engine.from_config(chosen, progress=False, on_progress=app.report_progress)

    app = ChatApp(factory_for_model(model), model_label=model or DEFAULT_MODEL, factory_for_model=factory_for_model,
                  started_at=STARTED_AT, load_note=last.note)
    app.run()
    if app.load_error is not None:  # the screen is gone: leave the reason in the terminal, as `generate` does
        print(f"tinymlx: error: {app.load_error}", file=sys.stderr)
    return app.return_code or 0
