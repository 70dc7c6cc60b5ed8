"""A real tinymlx server on a free loopback port, in a background thread, for the server tests."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from tinymlx.engine.engine import Engine
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


class Exchange:
    """One HTTP request the server answered: its path and body, the response's status and whole body."""

    def __init__(self, method: str, path: str):
        self.method, self.path = method, path
        self.request = bytearray()
        self.status: int | None = None
        self.body = bytearray()


class Recorder:
    """ASGI middleware keeping every exchange, in order of arrival."""

    def __init__(self, app):
        self.app = app
        self.exchanges: list[Exchange] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        exchange = Exchange(scope["method"], scope["path"])
        self.exchanges.append(exchange)

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                exchange.request += message.get("body", b"")
            return message

        async def recording_send(message):
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
            elif message["type"] == "http.response.body":
                exchange.body += message.get("body", b"")
            await send(message)

        await self.app(scope, recording_receive, recording_send)


class RunningServer:
    def __init__(self, engine: Engine, config: ServerConfig | None = None, record: bool = False):
        self.engine = engine
        self.server = OpenAIServer(engine, config)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.recorder = Recorder(self.server.app) if record else None
        app = self.recorder or self.server.app
        self._uvicorn = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
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
        while self.server.async_engine.stats().num_pages_used or self.engine.has_unfinished_requests:
            assert time.monotonic() < deadline, "the engine still holds requests or blocks"
            time.sleep(0.01)
        self.server.async_engine.check()

    def close(self) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout=10)
