"""ChatApp: load the model off the UI thread, then chat; `run_chat` is what `tinymlx chat` calls."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import mlx.core as mx
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from tinymlx.async_engine import AsyncEngine
from tinymlx.config import EngineConfig
from tinymlx.engine import Engine
from tinymlx.loader import ModelLoadError
from tinymlx.loader.offline import DEFAULT_MODEL
from tinymlx.models import resolve_dtype
from tinymlx_ui.messages import EngineFailed, EngineReady
from tinymlx_ui.screens.chat import ChatScreen
from tinymlx_ui.screens.error import ErrorScreen
from tinymlx_ui.screens.help import HelpScreen
from tinymlx_ui.screens.loading import LoadingScreen
from tinymlx_ui.session import SessionSettings
from tinymlx_ui.store import HistoryStore
from tinymlx_ui.widgets.prompt_input import PromptInput
from tinymlx_ui.widgets.status_bar import EngineInfo


class ChatApp(App):
    CSS_PATH = Path(__file__).with_name("app.tcss")  # absolute: Textual resolves relative to a subclass's file
    TITLE = "tinymlx chat"
    BINDINGS = [Binding("f1,question_mark", "help", "Help", tooltip="This help")]
    # Taller terminals get taller graphs (see app.tcss).
    VERTICAL_BREAKPOINTS = [(0, "-short"), (40, "-tall")]

    def __init__(self, engine_factory: Callable[[], Engine], *, model_label: str = DEFAULT_MODEL,
                 defaults: SessionSettings | None = None) -> None:
        super().__init__()
        self._engine_factory, self._model_label = engine_factory, model_label
        self._defaults = defaults or SessionSettings()
        self.async_engine: AsyncEngine | None = None

    def on_mount(self) -> None:
        self.push_screen(LoadingScreen(self._model_label))
        # A daemon thread, not a worker: quitting during a long first download must not wait for it.
        threading.Thread(target=self._load, name="tinymlx-ui-load", daemon=True).start()

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
        info = EngineInfo(
            engine.model_name, mx.default_device().type.name, resolve_dtype(engine.config.dtype),
            engine.config.num_blocks, engine.config.block_size, engine.config.tensor_parallel_size,
        )
        self.async_engine = AsyncEngine(engine)
        self.switch_screen(ChatScreen(self.async_engine, HistoryStore(), info, self._defaults))

    def on_engine_failed(self, message: EngineFailed) -> None:
        self.switch_screen(ErrorScreen(message.error))

    def on_unmount(self) -> None:
        if self.async_engine is not None:
            self.async_engine.shutdown()
            self.async_engine.engine.close()

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.key_rows()))

    def key_rows(self) -> list[tuple[str, str]]:
        bindings = [*PromptInput.BINDINGS, *ChatScreen.BINDINGS, *self.BINDINGS,
                    Binding("ctrl+p", "command_palette", "Command palette"), Binding("ctrl+q", "quit", "Quit")]
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
            yield SystemCommand("Session settings", "System prompt, temperature, max tokens, JSON output", screen.action_settings)
            yield SystemCommand("Cancel reply", "Stop the current session's reply", screen.action_cancel_reply)
            yield SystemCommand("Toggle engine panel", "Show or hide the engine panel", screen.action_toggle_panel)


def run_chat(model: str | None = None, *, block_size: int = 16, num_blocks: int | None = None,
             max_num_seqs: int = 32, dtype: str = "auto", max_num_batched_tokens: int = 512,
             tensor_parallel_size: int = 1, hostfile: str | None = None, scheduling_policy: str = "fcfs",
             speculative: str | None = None) -> None:
    """Run `tinymlx chat`. Bad engine arguments raise ValueError here, before the UI starts."""
    config = EngineConfig(model=model, block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                          dtype=dtype, max_num_batched_tokens=max_num_batched_tokens,
                          tensor_parallel_size=tensor_parallel_size, hostfile=hostfile,
                          scheduling_policy=scheduling_policy, speculative=speculative)
    ChatApp(functools.partial(Engine.from_config, config, progress=False), model_label=model or DEFAULT_MODEL).run()
