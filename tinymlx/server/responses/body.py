"""The Response object's JSON: its output items (reasoning, message, function calls), status, usage,
and the fields it repeats of the request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tinymlx.server.responses.sealed_reasoning import seal
from tinymlx.server.responses.tools import ToolOrigin
from tinymlx.turns.api_error import APIError
from tinymlx.turns.tool_schema import json_value
from tinymlx.turns.turn import Message, ToolCall, TurnRequest, TurnResult


@dataclass
class ResponsesTurnRequest(TurnRequest):
    """A TurnRequest plus what the store needs and what the Response body repeats of the request."""

    history: tuple[Message, ...] = ()  # the conversation without the instructions: what a chained response inherits
    store: bool = True
    echo: dict[str, Any] = field(default_factory=dict)
    tool_origins: dict[str, ToolOrigin] = field(default_factory=dict)  # flattened and freeform tools
    summarizes_reasoning: bool = False  # reasoning.summary: the reasoning comes as its summary too
    seals_reasoning: bool = False  # include reasoning.encrypted_content


def response_body(model_name: str, request_id: str, request: TurnRequest, created_at: int, status: str,
                  output: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"id": request_id, "object": "response", "created_at": created_at, "status": status,
            "model": model_name, "output": output, "error": None, "incomplete_details": None,
            "usage": None, **_echo(request), **fields}


def finished_body(model_name: str, request_id: str, request: TurnRequest, result: TurnResult,
                  output: list[dict[str, Any]], created_at: int) -> dict[str, Any]:
    """The completed (or incomplete) Response."""
    status, incomplete = status_of(result.finish_reason)
    return response_body(model_name, request_id, request, created_at, status, output,
                         incomplete_details=incomplete, usage=_usage(result), completed_at=int(time.time()))


def output_item_id(prefix: str, request_id: str, index: int) -> str:
    base = request_id.removeprefix("resp_").removeprefix("resp-")
    return f"{prefix}_{base}_{index}"


def call_item(item_id: str, call: ToolCall, status: str, origin: ToolOrigin | None) -> dict[str, Any]:
    """A function_call item, or a custom tool's custom_tool_call with its raw input; either under the
    name the client gave, with its namespace."""
    named = {"name": origin.name, "namespace": origin.namespace} if origin and origin.namespace else \
        {"name": origin.name if origin else call.name}
    if origin is not None and origin.custom:
        return {"type": "custom_tool_call", "id": item_id, "call_id": call.id, **named,
                "input": custom_input(call.arguments), "status": status}
    return {"type": "function_call", "id": item_id, "call_id": call.id, **named, "arguments": call.arguments,
            "status": status}


def call_id_prefix(origin: ToolOrigin | None) -> str:
    """The output item id's prefix of a call: ctc for a custom tool's, fc for a function's."""
    return "ctc" if origin is not None and origin.custom else "fc"


def custom_input(arguments: str) -> str:
    """A freeform call's raw input out of its arguments {"input": ...} (what the grammar let through)."""
    try:
        value = json_value(arguments).get("input", "") if arguments else ""
    except (ValueError, AttributeError):
        return arguments
    return value if isinstance(value, str) else arguments


def reasoning_item(item_id: str, request: TurnRequest, text: str) -> dict[str, Any]:
    """A finished reasoning item: its text as content; as the summary when one was asked for; sealed
    in encrypted_content when the request included it."""
    item: dict[str, Any] = {"type": "reasoning", "id": item_id, "summary": [],
                            "content": [{"type": "reasoning_text", "text": text}]}
    if isinstance(request, ResponsesTurnRequest):
        if request.summarizes_reasoning:
            item["summary"] = [{"type": "summary_text", "text": text}]
        if request.seals_reasoning:
            item["encrypted_content"] = seal(text)
    return item


def tool_origins(request: TurnRequest) -> dict[str, ToolOrigin]:
    return request.tool_origins if isinstance(request, ResponsesTurnRequest) else {}


def output_items(request_id: str, request: TurnRequest, result: TurnResult) -> list[dict[str, Any]]:
    """reasoning, then the message (always one when there are no calls), then each call."""
    items: list[dict[str, Any]] = []
    if result.reasoning:
        items.append(reasoning_item(output_item_id("rs", request_id, 0), request, result.reasoning))
    if result.text or not result.tool_calls:
        items.append({"type": "message", "id": output_item_id("msg", request_id, len(items)),
                      "status": "completed", "role": "assistant",
                      "content": [{"type": "output_text", "text": result.text, "annotations": []}]})
    origins = tool_origins(request)
    for call in result.tool_calls:
        origin = origins.get(call.name)
        items.append(call_item(output_item_id(call_id_prefix(origin), request_id, len(items)), call, "completed",
                               origin))
    if status_of(result.finish_reason)[0] == "incomplete" and "status" in items[-1]:
        items[-1]["status"] = "incomplete"
    return items


def status_of(finish_reason: str) -> tuple[str, dict[str, Any] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "incomplete", {"reason": None}
    return "completed", None


def _usage(result: TurnResult) -> dict[str, Any]:
    # cache_write_tokens: 0, nothing is billed for filling the prefix cache; reasoning tokens are not
    # counted apart from the rest of the reply (TurnResult has no such count).
    return {"input_tokens": result.num_prompt_tokens, "output_tokens": result.num_completion_tokens,
            "total_tokens": result.num_prompt_tokens + result.num_completion_tokens,
            "input_tokens_details": {"cached_tokens": result.num_cached_tokens, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def failure_code(error: APIError) -> str:
    """ResponseError.code is one of a fixed list; the APIError's own code stays in the message."""
    return {400: "invalid_prompt", 429: "rate_limit_exceeded"}.get(error.status, "server_error")


def _echo(request: TurnRequest) -> dict[str, Any]:
    if isinstance(request, ResponsesTurnRequest):
        return request.echo
    turn = request.turn
    choice = turn.tool_choice if turn.tool_choice in ("auto", "none", "required") else \
        {"type": "function", "name": turn.tool_choice}
    return {"tools": [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
                       "strict": True} for t in turn.tools],
            "tool_choice": choice, "parallel_tool_calls": turn.parallel_tool_calls, "store": True,
            "temperature": request.sampling.get("temperature"), "top_p": request.sampling.get("top_p"),
            "max_output_tokens": request.max_tokens, "user": request.user, "metadata": {}}
