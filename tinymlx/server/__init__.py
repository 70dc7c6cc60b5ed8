"""`tinymlx serve`: an HTTP server over the engine (FastAPI on uvicorn) speaking OpenAI's and Anthropic's APIs.

The app (and FastAPI with it) loads on first use, so the parsers here (tool_calls, reasoning) serve
the CLI and the chat UI on an install without the `serve` extra.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
from typing import TYPE_CHECKING

from tinymlx.server.server_config import ServerConfig

if TYPE_CHECKING:
    from tinymlx.engine.engine import Engine
    from tinymlx.server.app import OpenAIServer

__all__ = ["OpenAIServer", "ServerConfig", "serve"]


def __getattr__(name: str):
    if name == "OpenAIServer":
        return getattr(importlib.import_module("tinymlx.server.app"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def serve(server: OpenAIServer, host: str = "127.0.0.1", port: int = 8321, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM. Then drain: refuse new requests (503), let in-flight ones finish
    for up to the config's `drain_timeout_s`, and stop the engine."""
    import uvicorn

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    request_log = logging.getLogger("tinymlx.server")
    request_log.addHandler(handler)
    request_log.setLevel(log_level.upper())
    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=server.config.drain_timeout_s)
    http = uvicorn.Server(config)
    server.is_draining = lambda: http.should_exit
    prepare_grammars(server.engine)
    print(f"tinymlx serve: {server.model_name} at http://{host}:{port}/v1", file=sys.stderr)
    http.run()


def prepare_grammars(engine: Engine) -> threading.Thread:
    """Build the engine's grammar vocabulary (the tokenizer wrapped for llguidance: ~1.3 s for 150k
    tokens) on a thread of its own: every turn that offers tools samples under a call grammar, and an
    agent's first turn would otherwise wait for it. A request that comes first waits on the same lock."""
    thread = threading.Thread(target=lambda: engine.structured_output, name="tinymlx-grammar-vocabulary",
                              daemon=True)
    thread.start()
    return thread
