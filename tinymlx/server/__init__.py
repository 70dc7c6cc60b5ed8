"""`tinymlx serve`: an OpenAI-compatible HTTP server over the engine (FastAPI on uvicorn)."""

from __future__ import annotations

import logging
import sys

from tinymlx.server.app import OpenAIServer, ServerConfig

__all__ = ["OpenAIServer", "ServerConfig", "serve"]


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
    print(f"tinymlx serve: {server.model_name} at http://{host}:{port}/v1", file=sys.stderr)
    http.run()
