"""Running a request's choices on the engine: outputs as they come, timeouts, and one record each.

Every endpoint hands its admitted choices (a ValidRequest + an admission ticket) to
ChoiceRunner.outputs(), and gets each choice's cumulative outputs interleaved. Leaving the iterator
early (a client that went away, a timeout) aborts every choice still running.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tinymlx.core.outputs import RequestOutput
from tinymlx.core.request import ValidRequest
from tinymlx.engine.async_engine import AsyncEngine
from tinymlx.server.admission import Admission, Ticket
from tinymlx.server.metrics import ServerMetrics
from tinymlx.server.server_config import ServerConfig
from tinymlx.server.tracing import RequestTimes, RequestTracer
from tinymlx.turns.api_error import APIError
from tinymlx.turns.tool_calls import OutputParser

log = logging.getLogger("tinymlx.server")


@dataclass
class Choice:
    index: int
    prompt_index: int
    request: ValidRequest  # its prompt and params, checked once (Engine.validate)
    ticket: Ticket
    echo: str = ""
    parser: OutputParser | None = None  # chat replies: text, reasoning and tool calls apart
    latest: RequestOutput | None = None  # its cumulative output so far

    @property
    def final(self) -> RequestOutput | None:
        return self.latest if self.latest is not None and self.latest.finished else None


@dataclass
class Record:
    """What one request did, for its log line, metrics and trace."""

    endpoint: str
    received_ns: int = field(default_factory=time.time_ns)
    request_id: str = "-"
    status: int = 200
    outcome: str = "success"  # success | cancelled | timeout | rejected | invalid | error
    error: str | None = None  # what the client was told, for a request that did not succeed
    user: str | None = None
    submitted_ns: int | None = None
    num_prompt_tokens: int = 0
    n: int = 1
    choices: list[Choice] = field(default_factory=list)

    @property
    def num_cached_tokens(self) -> int:
        # Each prompt counts once, as OpenAI counts it: its cached tokens are those of its first choice.
        return sum(c.final.metrics.num_cached_tokens for c in self.choices
                   if c.final is not None and c.index % self.n == 0)

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(c.final.token_ids) for c in self.choices if c.final is not None)


class ChoiceRunner:
    def __init__(self, async_engine: AsyncEngine, admission: Admission, metrics: ServerMetrics,
                 config: ServerConfig, tracer: RequestTracer | None):
        self.async_engine, self.admission, self.metrics = async_engine, admission, metrics
        self.config, self.tracer = config, tracer

    async def outputs(self, choices: list[Choice], record: Record, tenant: str, priority: int
                      ) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Every choice's outputs as they come, interleaved. Leaving early aborts all of them."""
        queue: asyncio.Queue = asyncio.Queue()

        async def run(choice: Choice) -> None:
            try:
                request = choice.request
                stream = self.async_engine.generate(request.token_ids, request.params,
                                                    f"{record.request_id}-{choice.index}", priority=priority,
                                                    tenant=tenant, checked=request)
                async for output in self._timed(choice, stream):
                    queue.put_nowait((choice, output))
                queue.put_nowait((choice, None))
            except Exception as error:  # noqa: BLE001 - handed to the consumer, which raises it
                queue.put_nowait((choice, error))

        tasks = [asyncio.create_task(run(choice)) for choice in choices]
        try:
            remaining = len(tasks)
            while remaining:
                choice, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    choice.latest = item
                    yield choice, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _timed(self, choice: Choice, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
        """The choice's outputs within the configured timeouts; its queue ticket ends at its first token."""
        started = last_token = time.monotonic()
        iterator, in_queue = aiter(stream), True
        try:
            while True:
                timeout, code = self._time_left(started, in_queue)
                try:
                    output = await asyncio.wait_for(anext(iterator), timeout)
                except StopAsyncIteration:
                    return
                except asyncio.TimeoutError:
                    raise self._timeout_error(code) from None
                now = time.monotonic()
                if output.delta_token_ids:
                    if in_queue:
                        in_queue = False
                        self.admission.started(choice.ticket)
                    else:
                        self.metrics.inter_token.observe((now - last_token) / len(output.delta_token_ids))
                    last_token = now
                yield output
        finally:
            if in_queue:
                self.admission.started(choice.ticket)
            await iterator.aclose()

    def _time_left(self, started: float, in_queue: bool) -> tuple[float | None, str]:
        deadlines = []
        if in_queue and self.config.queue_timeout_s is not None:
            deadlines.append((started + self.config.queue_timeout_s, "queue_timeout"))
        if self.config.request_timeout_s is not None:
            deadlines.append((started + self.config.request_timeout_s, "request_timeout"))
        if not deadlines:
            return None, ""
        deadline, code = min(deadlines)
        return max(0.0, deadline - time.monotonic()), code

    def _timeout_error(self, code: str) -> APIError:
        if code == "queue_timeout":
            return APIError(503, f"no token within the queue timeout of {self.config.queue_timeout_s} s; retry later",
                            code=code, error_type="server_overloaded",
                            headers={"Retry-After": str(self.config.retry_after_s)})
        return APIError(504, f"the request ran past the request timeout of {self.config.request_timeout_s} s",
                        code=code, error_type="server_error")

    def finish(self, record: Record) -> None:
        """Metrics, one log line and (with tracing) one trace per request."""
        self.metrics.requests.labels(record.endpoint, record.outcome).inc()
        outputs = [c.latest for c in record.choices if c.latest is not None]
        for output in outputs:
            if output.metrics.queue_s is not None:
                self.metrics.queue_wait.observe(output.metrics.queue_s)
            if output.metrics.ttft_s is not None:
                self.metrics.ttft.observe(output.metrics.ttft_s)
        first = outputs[0].metrics if outputs else None
        line = {"request_id": record.request_id, "endpoint": record.endpoint, "status": record.status,
                "outcome": record.outcome, "user": record.user, "n": len(record.choices),
                "prompt_tokens": record.num_prompt_tokens,
                "output_tokens": sum(len(o.token_ids) for o in outputs),
                "cached_tokens": sum(o.metrics.num_cached_tokens for o in outputs),
                "queue_s": _round(first.queue_s if first else None), "ttft_s": _round(first.ttft_s if first else None),
                "duration_s": _round((time.time_ns() - record.received_ns) / 1e9)}
        if record.error is not None:  # the log says why, as the client was told (an agent CLI may not show it)
            line["error"] = record.error
        log.info(json.dumps(line))
        if self.tracer is not None and record.submitted_ns is not None:
            self.tracer.record(f"{record.endpoint} {record.request_id}", _times(record, first), line)


def failed(record: Record, error: Exception) -> APIError:
    """Record how a request that was under way failed (a timeout, or the engine's death)."""
    if not isinstance(error, APIError):
        error = APIError(503, f"{error}", code="engine_dead", error_type="server_error")
    record.outcome = "timeout" if error.code in ("queue_timeout", "request_timeout") else "error"
    record.status, record.error = error.status, error.message
    return error


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _times(record: Record, first: Any) -> RequestTimes:
    """Wall-clock stage times: the engine measures from its own arrival, right after submission."""
    def at(offset_s: float | None) -> int | None:
        return None if offset_s is None else record.submitted_ns + int(offset_s * 1e9)

    return RequestTimes(record.received_ns, record.submitted_ns, at(first.queue_s if first else None),
                        at(first.ttft_s if first else None), time.time_ns())
