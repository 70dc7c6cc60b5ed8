"""The HTTP server: FastAPI over AsyncEngine, a client like the chat UI. Three wire formats:

    POST /v1/chat/completions, /v1/completions     OpenAI (JSON, or SSE ending in [DONE]); tools, reasoning
    POST /v1/messages, /v1/messages/count_tokens   Anthropic Messages
    POST /v1/responses, GET /v1/responses/{id}     OpenAI Responses (previous_response_id from a bounded store)
    GET  /v1/models, /metrics (Prometheus), /health (503 once the step loop has died)

A request goes: parse (400 naming the field, in the API's own error shape) -> model (404) ->
admission (503 + Retry-After) -> one engine request per choice (n > 1 shares the prompt's blocks
through the prefix cache) -> response or stream. A client that goes away, a timeout or the end of
the stream aborts every choice still running, which frees its blocks at the engine's next step.
Chat replies pass through an OutputParser (reasoning, tool calls); every API renders its history
through the same chat template, so an agent's next turn reuses this turn's blocks. A turn's http(s)
image URLs are fetched before its prompt is made (turn_images.py, image_fetch.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException

from tinymlx.core.images import PromptImages
from tinymlx.core.request import ValidRequest
from tinymlx.core.sampling_params import SamplingParams
from tinymlx.engine.async_engine import AsyncEngine
from tinymlx.engine.engine import Engine
from tinymlx.sched.scheduler import RequestTooLargeError
from tinymlx.server.admission import Admission
from tinymlx.server.anthropic.messages import AnthropicMessages
from tinymlx.server.choices import Choice, ChoiceRunner, Record
from tinymlx.server.http_flow import collect, error_response, guarded, json_body, json_event, parse_body, sse
from tinymlx.server.image_fetch import ImageFetcher
from tinymlx.server.metrics import ServerMetrics
from tinymlx.server.openai.chat_body import ResponseBuilder, finish_reason_of, usage
from tinymlx.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from tinymlx.server.responses.api import OpenAIResponses
from tinymlx.server.served_models import ServedModels
from tinymlx.server.server_config import ServerConfig
from tinymlx.server.tracing import RequestTracer, tracing_requested
from tinymlx.server.turn_images import TurnImages
from tinymlx.turns.api_error import APIError
from tinymlx.turns.turn import ChatTurn, TurnRequest, TurnResult, WireFormat
from tinymlx.turns.turn_template import TurnTemplate


class OpenAIServer:
    def __init__(self, engine: Engine, config: ServerConfig | None = None):
        self.config = config or ServerConfig()
        self.engine = engine
        self.served = ServedModels(self.config.served_model_names or (engine.model_name,))
        self.model_name = self.served.name
        self.template = TurnTemplate(engine, self.config.tool_call_parser)
        self.metrics = ServerMetrics(lambda: self.async_engine.stats())
        fetcher = ImageFetcher(self.config.image_fetch_timeout_s, self.config.allow_private_image_urls)
        self.images = TurnImages(engine.images.sees_images, engine.config, fetcher, self.metrics.images_omitted)
        self.async_engine = AsyncEngine(engine, on_step=self.metrics.observe_step)
        self.admission = Admission(self.config.max_queue, engine.kv_blocks_for, self.config.retry_after_s)
        tracer = RequestTracer() if tracing_requested(self.config.otel) else None
        self.runner = ChoiceRunner(self.async_engine, self.admission, self.metrics, self.config, tracer)
        self.messages_api = AnthropicMessages(self.served)
        self.responses_api = OpenAIResponses(self.model_name, self.config.responses_store_size)
        self.is_draining: Callable[[], bool] = lambda: False  # serve() ties this to uvicorn's shutdown
        self.created = int(time.time())
        self.app = self._build_app()

    # -- the app ----------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_app: FastAPI):
            yield
            self.async_engine.shutdown()
            if self.runner.tracer is not None:
                self.runner.tracer.shutdown()

        app = FastAPI(title="tinymlx", lifespan=lifespan)
        app.add_exception_handler(APIError, lambda _request, error: error_response(error))
        app.add_exception_handler(HTTPException, lambda _request, error: error_response(
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
            models = [{"id": name, "object": "model", "created": self.created, "owned_by": "tinymlx",
                       "max_model_len": self.engine.config.max_model_len} for name in self.served.names]
            return JSONResponse({"object": "list", "data": models})

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> Response:
            return await self._serve(request, "chat")

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._serve(request, "completion")

        @app.post("/v1/messages")
        async def messages(request: Request) -> Response:
            return await self._serve_turn(request, self.messages_api)

        @app.post("/v1/messages/count_tokens")
        async def count_tokens(request: Request) -> Response:
            try:
                self._authorize(request)
                turn = await self.images.fetched(self.messages_api.parse_count(await json_body(request)))
                return JSONResponse({"input_tokens": len(self.template.prepare(turn).token_ids)})
            except APIError as error:
                return JSONResponse(self.messages_api.error_body(error), status_code=error.status)

        @app.post("/v1/responses")
        async def responses(request: Request) -> Response:
            return await self._serve_turn(request, self.responses_api)

        @app.get("/v1/responses/{response_id}")
        async def stored_response(request: Request, response_id: str) -> Response:
            self._authorize(request)
            body = self.responses_api.get(response_id)
            if body is None:
                raise APIError(404, f"no stored response with id {response_id!r}", "response_id", "response_not_found")
            return JSONResponse(body)

        return app

    def _authorize(self, request: Request) -> None:
        """OpenAI clients send the key as a bearer token, Anthropic's as x-api-key: either will do."""
        key = self.config.api_key
        if key and request.headers.get("authorization") != f"Bearer {key}" and request.headers.get("x-api-key") != key:
            raise APIError(401, "incorrect or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key')",
                           code="invalid_api_key")

    def _check_serving(self, model: str) -> None:
        self.served.check(model)
        if not self.async_engine.is_alive:
            raise APIError(503, "the engine's step loop has died; the server must be restarted",
                           code="engine_dead", error_type="server_error")
        if self.is_draining():
            raise APIError(503, "the server is shutting down", code="shutting_down", error_type="server_error")

    def _refused(self, record: Record, error: APIError) -> None:
        record.status, record.error = error.status, error.message
        record.outcome = "rejected" if error.status == 503 else "invalid"
        if error.code in ("queue_full", "kv_full"):
            self.metrics.rejections.labels(error.code).inc()
        self.runner.finish(record)

    # -- chat and text completions (n choices) --------------------------------------------------------
    async def _serve(self, http: Request, endpoint: str) -> Response:
        record = Record(endpoint)
        try:
            self._authorize(http)
            request = parse_body(ChatCompletionRequest if endpoint == "chat" else CompletionRequest, await json_body(http))
            record.user = request.user
            self._check_serving(request.model)
            request.check_supported()
            turn = await self.images.fetched(request.turn()) if isinstance(request, ChatCompletionRequest) else None
            choices = self._admit(request, record, turn)
        except APIError as error:
            self._refused(record, error)
            return error_response(error)

        prefix = "chatcmpl" if endpoint == "chat" else "cmpl"
        record.request_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        record.submitted_ns = time.time_ns()
        builder = ResponseBuilder(endpoint, record.request_id, self.model_name, int(time.time()),
                                  self.engine.tokenizer)
        outputs = self.runner.outputs(choices, record, request.user or "default", request.priority)
        if request.stream:
            include_usage = request.stream_options is not None and request.stream_options.include_usage
            chunks = self._chunks(outputs, choices, builder, record, include_usage)
            return self._event_stream(guarded(chunks, outputs, record, self.runner,
                                               lambda error: [json_event(error.body())], done=True))
        refused = await collect(http, outputs, record, self.runner, error_response)
        if refused is not None:
            return refused
        for choice in choices:
            if choice.parser is not None:
                choice.parser.feed(choice.final.text)
                choice.parser.finish()
        body = builder.response([builder.choice(c.index, c.final, c.echo, c.parser) for c in choices],
                                usage(record.num_prompt_tokens, record.num_completion_tokens, record.num_cached_tokens))
        return JSONResponse(body)

    def _admit(self, request: ChatCompletionRequest | CompletionRequest, record: Record,
               turn: ChatTurn | None) -> list[Choice]:
        """Encode and check every prompt, then take admission tickets: one choice per prompt and n. `turn`: a
        chat request's, its images fetched."""
        prepared, grammar = None, None
        if turn is not None:
            prepared = self.template.prepare(turn)
            self.images.note_omitted(turn, record.endpoint)
            grammar = prepared.grammar
            if grammar is not None and request.constraint()[0] is not None:
                raise APIError(400, "tools and a structured-output constraint cannot be combined", "tools")
            prompts = [prepared.token_ids]
            echoes = [""]
        else:
            prompts = [self._encode(p, "prompt") for p in request.prompts()]
            if request.echo and request.logprobs is not None:
                raise APIError(400, "echo with logprobs is not supported", "echo")
            echoes = [self.engine.tokenizer.decode(p) if request.echo else "" for p in prompts]
        field = "messages" if record.endpoint == "chat" else "prompt"
        specs = []
        for prompt_index, token_ids in enumerate(prompts):
            for choice in range(request.n):
                params = request.sampling_params(self._max_tokens(request.requested_max_tokens, token_ids),
                                                 request.num_logprobs, choice)
                if grammar is not None:
                    params = dataclasses.replace(params, grammar=grammar)
                if turn is not None:
                    params = self.template.format.reading(params)
                specs.append((prompt_index, self._validate(token_ids, params, field, request.constraint()[0],
                                                           prepared.images if prepared is not None else None)))
        tickets = self.admission.admit([len(p) for p in prompts], request.n, self.async_engine.stats())
        record.num_prompt_tokens, record.n = sum(len(p) for p in prompts), request.n
        record.choices = [Choice(i, p, valid, ticket, echoes[p],
                                 self.template.parser(turn, prepared) if turn is not None else None)
                          for i, ((p, valid), ticket) in enumerate(zip(specs, tickets))]
        return record.choices

    def _max_tokens(self, requested: int | None, token_ids: list[int]) -> int:
        """The body's max_tokens, clamped to what the context and the pool leave (all of that when unset, as
        vLLM): a reply asked for more runs to the context's end and ends with the API's length reason, and
        the KV checks count only what can be generated (Claude Code always asks for 32000)."""
        if requested is not None and requested < 1:
            return requested  # SamplingParams names the field
        room = self.engine.max_new_tokens(len(token_ids))
        # No room at all: 1, so that validation names the prompt and the limit it fills.
        return max(1, room if requested is None else min(requested, room))

    def _validate(self, token_ids: list[int], params: SamplingParams, field: str,
                  constraint_field: str | None, images: PromptImages | None = None) -> ValidRequest:
        """Engine.validate, the engine's one check, before anything is queued: its errors as 400s."""
        try:
            return self.engine.validate(token_ids, params, images)
        except RequestTooLargeError as error:  # a prompt that fills the context or the pool (max_tokens is clamped)
            raise APIError(400, str(error), field, "context_length_exceeded") from None
        except ValueError as error:  # the constraint does not compile (once: the choices share it)
            raise APIError(400, str(error), constraint_field, "invalid_constraint") from None

    def _encode(self, prompt: str | list[int], field_name: str) -> list[int]:
        try:
            return self.engine.encode_prompt(prompt)
        except ValueError as error:
            raise APIError(400, f"{field_name}: {error}", field_name) from None

    async def _chunks(self, outputs, choices: list[Choice], builder: ResponseBuilder, record: Record,
                      include_usage: bool) -> AsyncIterator[dict]:
        reported = {c.index: 0 for c in choices}  # logprobs sent per choice
        if record.endpoint == "chat":
            yield json_event(builder.chunk([builder.role_delta(c.index) for c in choices]))
        elif any(c.echo for c in choices):
            yield json_event(builder.chunk([builder.delta(c.index, c.echo, None, None) for c in choices]))
        async for choice, output in outputs:
            new_logprobs = None
            if output.logprobs is not None:
                new_logprobs = output.logprobs[reported[choice.index]:]
                reported[choice.index] = len(output.logprobs)
            if choice.parser is not None:
                events = choice.parser.feed(output.delta_text) + (choice.parser.finish() if output.finished else [])
                finish_reason = finish_reason_of(output, choice.parser) if output.finished else None  # after the feed
                if events or output.finished or new_logprobs:
                    delta = builder.chat_delta(choice.index, events, new_logprobs, finish_reason)
                    yield json_event(builder.chunk([delta]))
            elif output.delta_text or output.finished or new_logprobs:
                finish_reason = output.finish_reason if output.finished else None
                offset = len(choice.echo) + len(output.text) - len(output.delta_text)
                delta = builder.delta(choice.index, output.delta_text, new_logprobs, finish_reason, offset)
                yield json_event(builder.chunk([delta]))
        if include_usage:
            yield json_event(builder.chunk([], usage(record.num_prompt_tokens, record.num_completion_tokens,
                                                 record.num_cached_tokens)))

    def _event_stream(self, events: AsyncIterator[dict]) -> EventSourceResponse:
        # On shutdown sse-starlette would cut streams at once; let them finish within the drain timeout.
        return EventSourceResponse(events, sep="\n", shutdown_event=anyio.Event(),
                                   shutdown_grace_period=self.config.drain_timeout_s)

    # -- Anthropic Messages and OpenAI Responses (one choice, a wire format's shapes) ------------------
    async def _serve_turn(self, http: Request, wire: WireFormat) -> Response:
        record = Record(wire.name)

        def refuse(error: APIError) -> JSONResponse:
            return JSONResponse(wire.error_body(error), status_code=error.status, headers=error.headers)

        try:
            self._authorize(http)
            request = wire.parse(await json_body(http))
            record.user = request.user
            self._check_serving(request.model)
            request = dataclasses.replace(request, turn=await self.images.fetched(request.turn))
            choice = self._admit_turn(request, wire, record)
        except APIError as error:
            self._refused(record, error)
            return refuse(error)

        record.request_id = f"{wire.id_prefix}_{uuid.uuid4().hex[:24]}"
        record.submitted_ns = time.time_ns()
        outputs = self.runner.outputs([choice], record, request.user or "default", request.priority)
        if request.stream:
            stream = wire.stream(record.request_id, request)
            events = self._turn_events(outputs, choice, stream, record)
            return self._event_stream(guarded(events, outputs, record, self.runner,
                                               lambda error: [sse(e) for e in stream.error(error)]))
        refused = await collect(http, outputs, record, self.runner, refuse)
        if refused is not None:
            return refused
        choice.parser.feed(choice.final.text)
        choice.parser.finish()
        return JSONResponse(wire.response(record.request_id, request, _turn_result(choice, record)))

    def _admit_turn(self, request: TurnRequest, wire: WireFormat, record: Record) -> Choice:
        turn = request.turn
        prepared = self.template.prepare(turn)
        self.images.note_omitted(turn, record.endpoint)
        token_ids, constraint = prepared.token_ids, dict(request.constraint)
        if prepared.grammar is not None:
            if constraint:
                raise APIError(400, "tools and a structured-output format cannot be combined", "tools")
            constraint = {"grammar": prepared.grammar}
        try:
            params = self.template.format.reading(SamplingParams(
                **request.sampling, **constraint, max_tokens=self._max_tokens(request.max_tokens, token_ids)))
        except ValueError as error:  # SamplingParams names the field first: "top_p must be in ..."
            raise APIError(400, str(error), str(error).split(" ", 1)[0]) from None
        valid = self._validate(token_ids, params, wire.prompt_field, "text" if request.constraint else "tools",
                               prepared.images)
        ticket, = self.admission.admit([len(token_ids)], 1, self.async_engine.stats())
        record.num_prompt_tokens = len(token_ids)
        record.choices = [Choice(0, 0, valid, ticket, parser=self.template.parser(turn, prepared))]
        return record.choices[0]

    async def _turn_events(self, outputs, choice: Choice, stream, record: Record) -> AsyncIterator[dict]:
        started = False
        async for _choice, output in outputs:
            if not started:  # at the first token, when the prefix cache's share of the prompt is known
                started = True
                for event in stream.start(record.num_prompt_tokens, output.metrics.num_cached_tokens):
                    yield sse(event)
            events = choice.parser.feed(output.delta_text) + (choice.parser.finish() if output.finished else [])
            for turn_event in events:
                for event in stream.event(turn_event):
                    yield sse(event)
        for event in stream.finish(_turn_result(choice, record)):
            yield sse(event)


def _turn_result(choice: Choice, record: Record) -> TurnResult:
    output, parser = choice.final, choice.parser
    return TurnResult(parser.text, parser.reasoning, parser.tool_calls, finish_reason_of(output, parser),
                      record.num_prompt_tokens, len(output.token_ids), output.metrics.num_cached_tokens,
                      output.stop_sequence)
