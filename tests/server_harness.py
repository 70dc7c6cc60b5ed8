"""A real tinymlx server on a free loopback port, in a background thread, for the server tests."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from tinymlx.engine import Engine
from tinymlx.server import OpenAIServer, ServerConfig


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def slowed(engine: Engine, step_delay_s: float) -> Engine:
    """The tiny model is so fast that requests end before others arrive; a delay per step keeps
    them in flight together, as on a real model."""
    step = engine.step
    engine.step = lambda: time.sleep(step_delay_s) or step()
    return engine


class RunningServer:
    def __init__(self, engine: Engine, config: ServerConfig | None = None):
        self.engine = engine
        self.server = OpenAIServer(engine, config)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._uvicorn = uvicorn.Server(uvicorn.Config(self.server.app, host="127.0.0.1", port=self.port,
                                                      log_level="warning", access_log=False))
        self._thread = threading.Thread(target=self._uvicorn.run, name="test-server", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._uvicorn.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)

    @property
    def model(self) -> str:
        return self.server.model_name

    def wait_idle(self, timeout_s: float = 5.0) -> None:
        """Until the engine holds no request and no block (and its invariants hold)."""
        deadline = time.monotonic() + timeout_s
        while self.server.async_engine.stats().num_blocks_used or self.engine.has_unfinished_requests:
            assert time.monotonic() < deadline, "the engine still holds requests or blocks"
            time.sleep(0.01)
        self.server.async_engine.check()

    def close(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=10)
