"""AsyncEngine: the step loop on a background thread, an async iterator of deltas per request.

The engine is not thread-safe, so only the loop thread touches it. A request is validated up front,
in the caller (Engine.prepare: bad input raises there, at once), and adds and aborts are handed over
through a command queue, which the loop drains between steps. Outputs travel back to each caller's
event loop with `call_soon_threadsafe`. Stats are snapshotted after every step, so reading them never waits.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from tinymlx.core.outputs import EngineStats, RequestOutput
from tinymlx.core.request import ValidRequest
from tinymlx.core.sampling_params import SamplingParams
from tinymlx.engine.engine import Engine, Prompt


class EngineDeadError(RuntimeError):
    """The step loop failed; the engine serves no more requests."""


class AsyncEngine:
    def __init__(self, engine: Engine, idle_wait_s: float = 0.05,
                 on_step: Callable[[EngineStats], None] | None = None):
        """`on_step`: called on the loop thread with the stats after every step (metrics)."""
        self.engine, self._on_step = engine, on_step
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = engine.stats()
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tinymlx-step-loop", daemon=True)
        self._thread.start()

    # -- caller side --------------------------------------------------------------------------
    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0, tenant: str = "default",
                       checked: ValidRequest | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; leaving the loop early (or cancelling) aborts the request. The
        request is checked here, in the caller (Engine.prepare), unless `checked` says it was (add_request)."""
        self._raise_if_dead()
        request = self.engine.prepare(prompt, params, checked)
        request_id = request_id or f"req-{uuid.uuid4().hex[:12]}"
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        self._send("add", (request, request_id, priority, tenant))
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                if isinstance(output, BaseException):
                    raise output
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send("abort", request_id)

    def abort(self, request_id: str) -> None:
        self._send("abort", request_id)

    @property
    def is_alive(self) -> bool:
        """False once the step loop has failed (a supervisor should restart the engine)."""
        return self._error is None

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step."""
        return self._stats

    def set_disk_cache(self, enabled: bool) -> None:
        """Turn the prefix cache's disk tier off or back on, between steps (Engine.set_disk_cache)."""
        self._send("disk_cache", enabled)

    def check(self) -> None:
        """Run the engine's integrity check on the loop thread, between steps."""
        done = threading.Event()
        failure: list[BaseException] = []
        self._send("check", (done, failure))
        done.wait()
        if failure:
            raise failure[0]

    def shutdown(self) -> None:
        """Stop the step loop, then close the engine (Engine.close: its memory, ranks and disk writes). Left
        open at exit, the engine's last step may still be in flight, and the process could abort."""
        self._stopping = True
        self._wakeup.set()
        self._thread.join(timeout=30)
        if self._thread.is_alive():  # a step still under way: closing beneath it would race MLX on its arrays
            return
        self.engine.close()

    def _send(self, command: str, payload: Any) -> None:
        self._raise_if_dead()
        self._commands.put((command, payload))
        self._wakeup.set()

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine's step loop failed: {self._error!r}") from self._error

    # -- loop side ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_commands()
                if not self.engine.has_unfinished_requests:
                    self.engine.check_alive()  # a tensor-parallel rank that dies is reported even when idle
                    self._wakeup.wait(self._idle_wait_s)
                    self._wakeup.clear()
                    continue
                outputs = self.engine.step()
                self._stats = self.engine.stats()
                if self._on_step is not None:
                    self._on_step(self._stats)
                for output in outputs:
                    self._deliver(output.request_id, output)
        except BaseException as error:  # noqa: BLE001 - every stream must hear about it
            self._error = error
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"the engine's step loop failed: {error!r}"))

    def _drain_commands(self) -> None:
        while True:
            try:
                command, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                request, request_id, priority, tenant = payload
                try:
                    self.engine.add_request(request.token_ids, request.params, request_id, priority=priority,
                                            tenant=tenant, checked=request)
                except ValueError as error:  # e.g. a duplicate id: only that stream fails
                    self._deliver(request_id, error)
            elif command == "abort":
                self.engine.abort(payload)
            elif command == "disk_cache":
                self.engine.set_disk_cache(payload)
            elif command == "check":
                done, failure = payload
                try:
                    self.engine.check()
                except AssertionError as error:
                    failure.append(error)
                done.set()
            self._stats = self.engine.stats()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, outputs = stream
            loop.call_soon_threadsafe(outputs.put_nowait, item)
