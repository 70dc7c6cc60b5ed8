"""How a request travels over HTTP, whatever its wire format: the body read and validated, a
non-streamed reply run to its end (or abandoned when the client goes), a stream guarded so that it
ends in its API's error events on failure and aborts its choices however it ends."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable

import anyio
import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinymlx.engine.async_engine import EngineDeadError
from tinymlx.server.choices import ChoiceRunner, Record, failed
from tinymlx.turns.api_error import APIError
from tinymlx.turns.turn import SSEEvent


async def guarded(events: AsyncIterator[dict], outputs: AsyncIterator, record: Record, runner: ChoiceRunner,
                   on_error: Callable[[APIError], list[dict]], done: bool = False) -> AsyncIterator[dict]:
    """A stream's events, ended by its API's error events if the request fails under way; the
    record is finished and every choice aborted however the stream ends."""
    is_complete = False
    try:
        async for event in events:
            yield event
        is_complete = True
    except (APIError, EngineDeadError) as error:
        is_complete = True
        for event in on_error(failed(record, error)):
            yield event
    finally:
        # Cancelled at an await or closed at a yield: either way the client went away.
        if not is_complete:
            record.outcome, record.status = "cancelled", 499
        runner.finish(record)
        # Abort the choices still running now, not at garbage collection; shielded, because inside
        # sse-starlette's cancelled scope every await would be cancelled again.
        with anyio.CancelScope(shield=True):
            await events.aclose()
            await outputs.aclose()
    if done:  # OpenAI's chat and text completions end with [DONE]
        yield {"data": "[DONE]"}


async def collect(http: Request, outputs: AsyncIterator, record: Record, runner: ChoiceRunner,
                   refuse: Callable[[APIError], Response]) -> Response | None:
    """Run a non-streamed request to its end: None when it finished, else the response to send."""
    async def drain() -> None:
        async for _choice, _output in outputs:
            pass  # the runner keeps each choice's latest output

    work = asyncio.create_task(drain())
    watch = asyncio.create_task(disconnected(http))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():  # the client went away: abort every choice
            work.cancel()
            record.outcome, record.status = "cancelled", 499
            with contextlib.suppress(asyncio.CancelledError):
                await work
            return Response(status_code=499)
        work.result()
        return None
    except (APIError, EngineDeadError) as error:
        return refuse(failed(record, error))
    finally:
        watch.cancel()
        runner.finish(record)


async def json_body(http: Request) -> dict:
    try:
        body = json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"the body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


def parse_body(model: type[pydantic.BaseModel], body: dict):
    try:
        return model.model_validate(body)
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        param = str(first["loc"][0])
        got = "" if first["type"] == "missing" else f", got {first['input']!r}"
        raise APIError(400, f"{param}: {first['msg']}{got}", param) from None


async def disconnected(http: Request) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(0.05)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def json_event(body: dict) -> dict:
    return {"data": json.dumps(body, separators=(",", ":"))}


def sse(event: SSEEvent) -> dict:
    return {"data": event.data} if event.event is None else {"event": event.event, "data": event.data}
