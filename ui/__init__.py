"""tinymlx_ui: `tinymlx chat`, a terminal UI where several chats stream at once beside the engine's
KV blocks and batch, live."""

from tinymlx_ui.app import ChatApp, run_chat

__all__ = ["ChatApp", "run_chat"]
