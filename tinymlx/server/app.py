"""The OpenAI-compatible HTTP server: FastAPI over AsyncEngine, a client like the chat UI.

    POST /v1/chat/completions, /v1/completions   (JSON, or SSE with "stream": true, ending in [DONE])
    GET  /v1/models, /metrics (Prometheus), /health (503 once the step loop has died)

A request goes: parse (400 naming the field) -> model (404) -> admission (503 + Retry-After) ->
one engine request per choice (n > 1 shares the prompt's blocks through the prefix cache) ->
response or stream. A client that goes away, a timeout or the end of the stream aborts every
choice still running, which frees its blocks at the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import anyio
import pydantic
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from tinymlx.async_engine import AsyncEngine, EngineDeadError
from tinymlx.engine import Engine
from tinymlx.outputs import RequestOutput
from tinymlx.sampling_params import SamplingParams
from tinymlx.server.admission import Admission, Ticket
from tinymlx.server.metrics import ServerMetrics
from tinymlx.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from tinymlx.server.responses import ResponseBuilder, usage
from tinymlx.server.tracing import RequestTimes, RequestTracer, tracing_requested

log = logging.getLogger("tinymlx.server")


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str | None = None  # None: the engine's model name
    api_key: str | None = None  # every endpoint but /health then wants "Authorization: Bearer <key>"
    max_queue: int = 256  # admitted choices without a first token yet; more are refused (503)
    queue_timeout_s: float | None = None  # longest wait for a choice's first token
    request_timeout_s: float | None = None  # longest whole request
    retry_after_s: int = 1
    drain_timeout_s: float = 30.0  # on shutdown, how long streams in flight may still run
    otel: bool = False


@dataclass
class _Choice:
    index: int
    prompt_index: int
    token_ids: list[int]
    params: SamplingParams
    ticket: Ticket
    echo: str = ""
    latest: RequestOutput | None = None  # its cumulative output so far

    @property
    def final(self) -> RequestOutput | None:
        return self.latest if self.latest is not None and self.latest.finished else None


@dataclass
class _Record:
    """What one request did, for its log line, metrics and trace."""

    endpoint: str
    received_ns: int = field(default_factory=time.time_ns)
    request_id: str = "-"
    status: int = 200
    outcome: str = "success"  # success | cancelled | timeout | rejected | invalid | error
    user: str | None = None
    submitted_ns: int | None = None
    num_prompt_tokens: int = 0
    n: int = 1
    choices: list[_Choice] = field(default_factory=list)


class OpenAIServer:
    def __init__(self, engine: Engine, config: ServerConfig | None = None):
        self.config = config or ServerConfig()
        self.engine = engine
        self.model_name = self.config.served_model_name or engine.model_name
        self.metrics = ServerMetrics(lambda: self.async_engine.stats())
        self.async_engine = AsyncEngine(engine, on_step=self.metrics.observe_step)
        self.admission = Admission(self.config.max_queue, engine.config.block_size, self.config.retry_after_s)
        self.tracer = RequestTracer() if tracing_requested(self.config.otel) else None
        self.is_draining: Callable[[], bool] = lambda: False  # serve() ties this to uvicorn's shutdown
        self.created = int(time.time())
        self.app = self._build_app()

    # -- the app ----------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_app: FastAPI):
            yield
            self.async_engine.shutdown()
            self.engine.close()
            if self.tracer is not None:
                self.tracer.shutdown()

        app = FastAPI(title="tinymlx", lifespan=lifespan)
        app.add_exception_handler(APIError, lambda _request, error: _error_response(error))
        app.add_exception_handler(HTTPException, lambda _request, error: _error_response(
            APIError(error.status_code, str(error.detail), error_type="invalid_request_error")))

        @app.get("/health")
        async def health() -> Response:
            if not self.async_engine.is_alive:
                return JSONResponse({"status": "error", "reason": "the engine's step loop has died"}, status_code=503)
            return JSONResponse({"status": "draining" if self.is_draining() else "ok"})

        @app.get("/metrics")
        async def metrics(request: Request) -> Response:
            self._authorize(request)
            self.metrics.queue_depth.set(self.admission.num_queued)
            return Response(self.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models(request: Request) -> Response:
            self._authorize(request)
            model = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "tinymlx",
                     "max_model_len": self.engine.config.max_model_len}
            return JSONResponse({"object": "list", "data": [model]})

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await self._serve(request, "chat")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._serve(request, "completion")

        return app

    def _authorize(self, request: Request) -> None:
        if self.config.api_key and request.headers.get("authorization") != f"Bearer {self.config.api_key}":
            raise APIError(401, "incorrect or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")

    # -- one request ------------------------------------------------------------------------------
    async def _serve(self, http: Request, endpoint: str) -> Response:
        record = _Record(endpoint)
        try:
            self._authorize(http)
            request = _parse(ChatCompletionRequest if endpoint == "chat" else CompletionRequest, await _json(http))
            record.user = request.user
            if request.model != self.model_name:
                raise APIError(404, f"the model {request.model!r} does not exist; this server serves "
                                    f"{self.model_name!r}", "model", "model_not_found")
            request.check_supported()
            if not self.async_engine.is_alive:
                raise APIError(503, "the engine's step loop has died; the server must be restarted",
                               code="engine_dead", error_type="server_error")
            if self.is_draining():
                raise APIError(503, "the server is shutting down", code="shutting_down", error_type="server_error")
            choices = self._admit(request, record)
        except APIError as error:
            record.status = error.status
            record.outcome = "rejected" if error.status == 503 else "invalid"
            if error.code in ("queue_full", "kv_full"):
                self.metrics.rejections.labels(error.code).inc()
            self._finish(record)
            return _error_response(error)

        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        record.request_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        record.submitted_ns = time.time_ns()
        builder = ResponseBuilder(endpoint, record.request_id, self.model_name, int(time.time()),
                                  self.engine.tokenizer)
        if request.stream:
            include_usage = request.stream_options is not None and request.stream_options.include_usage
            # On shutdown sse-starlette would cut streams at once; let them finish within the drain timeout.
            return EventSourceResponse(self._stream(request, choices, builder, record, include_usage), sep="\n",
                                       shutdown_event=anyio.Event(), shutdown_grace_period=self.config.drain_timeout_s)
        return await self._respond(http, request, choices, builder, record)

    def _admit(self, request: ChatCompletionRequest | CompletionRequest, record: _Record) -> list[_Choice]:
        """Encode and check every prompt, then take admission tickets: one choice per prompt and n."""
        if isinstance(request, ChatCompletionRequest):
            prompts = [self._encode(request.conversation(), "messages")]
            echoes = [""]
        else:
            prompts = [self._encode(p, "prompt") for p in request.prompts()]
            if request.echo and request.logprobs is not None:
                raise APIError(400, "echo with logprobs is not supported", "echo")
            echoes = [self.engine.tokenizer.decode(p) if request.echo else "" for p in prompts]
        max_len = self.engine.config.max_model_len
        specs = []
        for prompt_index, token_ids in enumerate(prompts):
            # No max_tokens: as vLLM, whatever the context leaves.
            max_tokens = request.requested_max_tokens
            if max_tokens is None:
                max_tokens = max(1, max_len - len(token_ids))
            for choice in range(request.n):
                params = request.sampling_params(max_tokens, request.num_logprobs, choice)
                if params.constraint is not None and choice == 0:  # compiled once: the choices share it
                    try:
                        self.engine.check_constraint(params)
                    except ValueError as error:
                        raise APIError(400, str(error), request.constraint()[0], "invalid_constraint") from None
                try:
                    self.engine.validate(token_ids, params)
                except ValueError as error:  # prompt + max_tokens beyond the context or the pool
                    raise APIError(400, str(error), "messages" if record.endpoint == "chat" else "prompt",
                                   "context_length_exceeded") from None
                specs.append((prompt_index, token_ids, params))
        tickets = self.admission.admit([len(p) for p in prompts], request.n, self.async_engine.stats())
        record.num_prompt_tokens, record.n = sum(len(p) for p in prompts), request.n
        record.choices = [_Choice(i, p, ids, params, ticket, echoes[p])
                          for i, ((p, ids, params), ticket) in enumerate(zip(specs, tickets))]
        return record.choices

    def _encode(self, prompt: str | list[int] | list[dict], field_name: str) -> list[int]:
        try:
            return self.engine.encode_prompt(prompt)
        except ValueError as error:
            raise APIError(400, f"{field_name}: {error}", field_name) from None

    async def _respond(self, http: Request, request, choices: list[_Choice], builder: ResponseBuilder,
                       record: _Record) -> Response:
        async def collect() -> None:
            async for _choice, _output in self._outputs(request, choices, record):
                pass  # _outputs keeps each choice's latest output

        work = asyncio.create_task(collect())
        watch = asyncio.create_task(_disconnected(http))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the client went away: abort every choice
                work.cancel()
                record.outcome, record.status = "cancelled", 499
                with contextlib.suppress(asyncio.CancelledError):
                    await work
                return Response(status_code=499)
            work.result()
        except (APIError, EngineDeadError) as error:
            return _error_response(_failed(record, error))
        finally:
            watch.cancel()
            self._finish(record)
        body = builder.response([builder.choice(c.index, c.final, c.echo) for c in choices], self._usage(record))
        return JSONResponse(body)

    async def _stream(self, request, choices: list[_Choice], builder: ResponseBuilder, record: _Record,
                      include_usage: bool) -> AsyncIterator[dict]:
        reported = {c.index: 0 for c in choices}  # logprobs sent per choice
        outputs = self._outputs(request, choices, record)
        is_complete = False
        try:
            if record.endpoint == "chat":
                yield _event(builder.chunk([builder.role_delta(c.index) for c in choices]))
            elif any(c.echo for c in choices):
                yield _event(builder.chunk([builder.delta(c.index, c.echo, None, None) for c in choices]))
            async for choice, output in outputs:
                new_logprobs = None
                if output.logprobs is not None:
                    new_logprobs = output.logprobs[reported[choice.index]:]
                    reported[choice.index] = len(output.logprobs)
                if output.delta_text or output.finished or new_logprobs:
                    offset = len(choice.echo) + len(output.text) - len(output.delta_text)
                    delta = builder.delta(choice.index, output.delta_text, new_logprobs,
                                          output.finish_reason if output.finished else None, offset)
                    yield _event(builder.chunk([delta]))
            if include_usage:
                yield _event(builder.chunk([], self._usage(record)))
            is_complete = True
        except (APIError, EngineDeadError) as error:
            is_complete = True
            yield _event(_failed(record, error).body())
        finally:
            # Cancelled at an await or closed at a yield: either way the client went away.
            if not is_complete:
                record.outcome, record.status = "cancelled", 499
            self._finish(record)
            # Abort the choices still running now, not at garbage collection; shielded, because inside
            # sse-starlette's cancelled scope every await would be cancelled again.
            with anyio.CancelScope(shield=True):
                await outputs.aclose()
        yield {"data": "[DONE]"}

    async def _outputs(self, request, choices: list[_Choice], record: _Record
                       ) -> AsyncIterator[tuple[_Choice, RequestOutput]]:
        """Every choice's outputs as they come, interleaved. Leaving early aborts all of them."""
        queue: asyncio.Queue = asyncio.Queue()
        tenant = request.user or "default"

        async def run(choice: _Choice) -> None:
            try:
                stream = self.async_engine.generate(choice.token_ids, choice.params, f"{record.request_id}-{choice.index}",
                                                    priority=request.priority, tenant=tenant)
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

    async def _timed(self, choice: _Choice, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
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
                    raise _timeout_error(code, timeout_of=self.config) from None
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

    # -- bookkeeping ------------------------------------------------------------------------------
    def _usage(self, record: _Record) -> dict:
        finals = [c.final for c in record.choices if c.final is not None]
        # Each prompt counts once, as OpenAI counts it: its cached tokens are those of its first choice.
        cached = sum(c.final.metrics.num_cached_tokens for c in record.choices
                     if c.final is not None and c.index % record.n == 0)
        return usage(record.num_prompt_tokens, sum(len(f.token_ids) for f in finals), cached)

    def _finish(self, record: _Record) -> None:
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
                "queue_s": _round(first.queue_s if first else None), "ttft_s": _round(first.ttft_s if first else None),
                "duration_s": _round((time.time_ns() - record.received_ns) / 1e9)}
        log.info(json.dumps(line))
        if self.tracer is not None and record.submitted_ns is not None:
            self.tracer.record(f"{record.endpoint} {record.request_id}", _times(record, first), line)


# -- helpers -------------------------------------------------------------------------------------
async def _json(http: Request) -> dict:
    try:
        body = json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"the body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


def _parse(model: type[pydantic.BaseModel], body: dict):
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        param = str(first["loc"][0])
        got = "" if first["type"] == "missing" else f", got {first['input']!r}"
        raise APIError(400, f"{param}: {first['msg']}{got}", param) from None


async def _disconnected(http: Request) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(0.05)


def _timeout_error(code: str, timeout_of: ServerConfig) -> APIError:
    if code == "queue_timeout":
        return APIError(503, f"no token within the queue timeout of {timeout_of.queue_timeout_s} s; retry later",
                        code=code, error_type="server_overloaded",
                        headers={"Retry-After": str(timeout_of.retry_after_s)})
    return APIError(504, f"the request ran past the request timeout of {timeout_of.request_timeout_s} s",
                    code=code, error_type="server_error")


def _failed(record: _Record, error: APIError | EngineDeadError) -> APIError:
    """Record how a request that was under way failed (a timeout, or the engine's death)."""
    if not isinstance(error, APIError):
        error = APIError(503, f"{error}", code="engine_dead", error_type="server_error")
    record.outcome = "timeout" if error.code in ("queue_timeout", "request_timeout") else "error"
    record.status = error.status
    return error


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _event(body: dict) -> dict:
    return {"data": json.dumps(body, separators=(",", ":"))}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _times(record: _Record, first) -> RequestTimes:
    """Wall-clock stage times: the engine measures from its own arrival, right after submission."""
    def at(offset_s: float | None) -> int | None:
        return None if offset_s is None else record.submitted_ns + int(offset_s * 1e9)

    return RequestTimes(record.received_ns, record.submitted_ns, at(first.queue_s if first else None),
                        at(first.ttft_s if first else None), time.time_ns())
