"""A reply in the shapes of Anthropic's Messages API: the Message object, its event stream, and the
error body.

    TurnResult -> {"type": "message", "content": [thinking, text, tool_use...], "stop_reason", "usage"}
    TurnEvents -> message_start, ping, (content_block_start, content_block_delta*, content_block_stop)*,
                  message_delta (stop_reason, usage), message_stop
"""

from __future__ import annotations

import json
from typing import Any

from tinymlx.turns.api_error import APIError
from tinymlx.turns.turn import (
    ReasoningDelta,
    SSEEvent,
    TextDelta,
    ToolArgumentsDelta,
    ToolCallEnd,
    ToolCallStart,
    TurnEvent,
    TurnResult,
)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error",
                529: "overloaded_error"}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


def message_body(model_name: str, request_id: str, result: TurnResult) -> dict[str, Any]:
    """The finished reply as a Message: thinking, text, then each tool_use block."""
    content: list[dict[str, Any]] = []
    if result.reasoning:
        content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
    if result.text:
        content.append({"type": "text", "text": result.text})
    content += [{"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call.arguments)}
                for call in result.tool_calls]
    stop_reason, stop_sequence = _stop(result)
    return {"id": request_id, "type": "message", "role": "assistant", "model": model_name,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(result.num_prompt_tokens, result.num_cached_tokens, result.num_completion_tokens)}


def error_body(error: APIError) -> dict[str, Any]:
    """Anthropic's error shape, answered and streamed alike."""
    return {"type": "error", "error": {"type": _error_type(error), "message": error.message}}


class MessageStream:
    """One reply's events. A content block stays open while events of its kind come; the next kind
    closes it (Anthropic's blocks never interleave), so block indexes count up from 0."""

    def __init__(self, model_name: str, request_id: str):
        self._model_name, self._id = model_name, request_id
        self._index = -1  # the latest block's index
        self._open: str | None = None  # the open block's type
        self._call: int | None = None  # the open tool_use block's call index (ToolCallStart.index)

    def start(self, num_prompt_tokens: int = 0, num_cached_tokens: int = 0) -> list[SSEEvent]:
        """The prompt's counts are optional: message_delta repeats usage in full, as the API's does."""
        message = {"id": self._id, "type": "message", "role": "assistant", "model": self._model_name,
                   "content": [], "stop_reason": None, "stop_sequence": None,
                   "usage": _usage(num_prompt_tokens, num_cached_tokens, 0)}
        return [_sse({"type": "message_start", "message": message}), _sse({"type": "ping"})]

    def event(self, event: TurnEvent) -> list[SSEEvent]:
        if isinstance(event, (TextDelta, ReasoningDelta)):
            if not event.text:
                return []
            kind = "text" if isinstance(event, TextDelta) else "thinking"
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "",
                                                                           "signature": ""}
            opened = [] if self._open == kind else self._begin(block)
            return opened + [self._delta({"type": f"{kind}_delta", kind: event.text})]
        if isinstance(event, ToolCallStart):
            return self._begin({"type": "tool_use", "id": event.id, "name": event.name, "input": {}}, event.index)
        if isinstance(event, (ToolArgumentsDelta, ToolCallEnd)) and event.index != self._call:
            raise ValueError(f"{type(event).__name__} for call {event.index}, but the open block is "
                             f"{self._open!r} (call {self._call})")
        if isinstance(event, ToolArgumentsDelta):
            return [self._delta({"type": "input_json_delta", "partial_json": event.text})] if event.text else []
        if isinstance(event, ToolCallEnd):
            return self._end()
        raise TypeError(f"not a turn event: {event!r}")

    def finish(self, result: TurnResult) -> list[SSEEvent]:
        stop_reason, stop_sequence = _stop(result)
        usage = _usage(result.num_prompt_tokens, result.num_cached_tokens, result.num_completion_tokens)
        return self._end() + [
            _sse({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                  "usage": usage}),
            _sse({"type": "message_stop"})]

    def error(self, error: APIError) -> list[SSEEvent]:
        return [_sse(error_body(error))]

    def _begin(self, block: dict[str, Any], call: int | None = None) -> list[SSEEvent]:
        events = self._end()
        self._index, self._open, self._call = self._index + 1, block["type"], call
        return events + [_sse({"type": "content_block_start", "index": self._index, "content_block": block})]

    def _end(self) -> list[SSEEvent]:
        if self._open is None:
            return []
        # The API closes a thinking block with its signature; ours is empty (nothing to verify).
        events = [self._delta({"type": "signature_delta", "signature": ""})] if self._open == "thinking" else []
        self._open = self._call = None
        return events + [_sse({"type": "content_block_stop", "index": self._index})]

    def _delta(self, delta: dict[str, Any]) -> SSEEvent:
        return _sse({"type": "content_block_delta", "index": self._index, "delta": delta})


def _error_type(error: APIError) -> str:
    if error.status == 503:  # a full queue or pool is worth retrying; a dead engine or a shutdown is not
        return "overloaded_error" if error.error_type == "server_overloaded" else "api_error"
    return _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")


def _stop(result: TurnResult) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). Calls come first: a client runs them whatever ended the reply."""
    if result.tool_calls and result.finish_reason in ("stop", "tool_calls"):
        return "tool_use", None
    if result.finish_reason == "stop" and result.stop_sequence is not None:
        return "stop_sequence", result.stop_sequence
    return _STOP_REASONS.get(result.finish_reason, "end_turn"), None


def _usage(num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int) -> dict[str, int]:
    # Anthropic's total input is input + cache_creation + cache_read: input_tokens excludes cache reads.
    return {"input_tokens": max(0, num_prompt_tokens - num_cached_tokens), "output_tokens": num_output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": num_cached_tokens}


def _input(arguments: str) -> dict[str, Any]:
    """The call's input; {} for arguments max_tokens cut short (stop_reason says "max_tokens")."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    if not isinstance(value, dict):  # the call grammar makes objects; anything else is a parser bug
        raise ValueError(f"tool call arguments must be a JSON object, got {arguments!r}")
    return value


def _sse(body: dict[str, Any]) -> SSEEvent:
    return SSEEvent(json.dumps(body, separators=(",", ":")), body["type"])
