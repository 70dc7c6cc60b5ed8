"""One streamed Response of the Responses API, as its documented event sequence: each event carries
a sequence_number, and the last one (response.completed | incomplete | failed) the whole Response."""

from __future__ import annotations

import json
import time
from typing import Any

from tinymlx.server.responses.body import (
    ResponsesTurnRequest,
    call_id_prefix,
    call_item,
    custom_input,
    failure_code,
    finished_body,
    output_item_id,
    output_items,
    reasoning_item,
    response_body,
    status_of,
    tool_origins,
)
from tinymlx.server.responses.store import ResponseStore
from tinymlx.turns.api_error import APIError
from tinymlx.turns.turn import (
    ReasoningDelta,
    SSEEvent,
    TextDelta,
    ToolArgumentsDelta,
    ToolCall,
    ToolCallEnd,
    ToolCallStart,
    TurnEvent,
    TurnRequest,
    TurnResult,
)


class ResponsesStream:
    """One streamed Response: each output item opens on its first delta and closes when the next opens.

    reasoning: output_item.added, content_part.added, reasoning_text.delta..., reasoning_text.done,
               content_part.done, output_item.done        (a message the same, with output_text.*)
               (with reasoning.summary, reasoning_summary_part.added, reasoning_summary_text.delta... beside
               each reasoning_text.delta, and their done events after content_part.done)
    call:      output_item.added, function_call_arguments.delta..., function_call_arguments.done,
               output_item.done
    custom:    output_item.added, custom_tool_call_input.delta (the whole input, once the call closed:
               it streams as JSON arguments), custom_tool_call_input.done, output_item.done
    """

    def __init__(self, model_name: str, store: ResponseStore, request_id: str, request: TurnRequest):
        self._model_name, self._store, self._id, self._request = model_name, store, request_id, request
        self._created_at = int(time.time())
        self._num_events = 0  # sequence_number of the next event
        self._output: list[dict[str, Any]] = []  # every item so far, in its latest state
        self._open: str | None = None  # the type of the last item while it still takes deltas
        self._calls: dict[int, int] = {}  # ToolCallStart.index -> output index
        self._custom_arguments: dict[int, str] = {}  # output index -> a custom call's arguments so far
        self._origins = tool_origins(request)
        self._summarizes = isinstance(request, ResponsesTurnRequest) and request.summarizes_reasoning
        self._started = False

    def start(self, num_prompt_tokens: int = 0, num_cached_tokens: int = 0) -> list[SSEEvent]:
        """The counts are not part of these events: usage comes with response.completed."""
        self._started = True
        body = response_body(self._model_name, self._id, self._request, self._created_at, "in_progress", [])
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def event(self, event: TurnEvent) -> list[SSEEvent]:
        if isinstance(event, (TextDelta, ReasoningDelta)):
            return self._text(event) if event.text else []
        if isinstance(event, ToolCallStart):
            events = self._close("completed")
            self._calls[event.index] = len(self._output)
            origin = self._origins.get(event.name)
            if origin is not None and origin.custom:
                self._custom_arguments[len(self._output)] = ""
            item = call_item(self._item_id(call_id_prefix(origin)), ToolCall(event.id, event.name, ""),
                             "in_progress", origin)
            return events + self._add(item)
        if isinstance(event, ToolArgumentsDelta):
            index = self._calls.get(event.index)
            if index is None:  # a delta of a call that never started: nothing to attach it to
                return []
            if index in self._custom_arguments:
                self._custom_arguments[index] += event.text
                return []
            self._output[index]["arguments"] += event.text
            return [self._event("response.function_call_arguments.delta", item_id=self._output[index]["id"],
                                output_index=index, delta=event.text)] if event.text else []
        if isinstance(event, ToolCallEnd) and self._calls.get(event.index) == len(self._output) - 1:
            return self._close("completed")
        return []

    def finish(self, result: TurnResult) -> list[SSEEvent]:
        status, _ = status_of(result.finish_reason)
        events = self._close(status)
        output = self._output or output_items(self._id, self._request, result)  # a reply without deltas has items
        body = finished_body(self._model_name, self._id, self._request, result, output, self._created_at)
        self._store.keep(self._id, self._request, result, body)
        return events + [self._event(f"response.{status}", response=body)]

    def error(self, error: APIError) -> list[SSEEvent]:
        if not self._started:  # no Response exists yet for a response.failed to carry
            return [self._event("error", code=error.code, message=error.message, param=error.param)]
        if self._open is not None and "status" in self._output[-1]:
            self._output[-1]["status"] = "incomplete"
        failure = {"code": failure_code(error), "message": error.message, "param": error.param,
                   "type": error.error_type}
        body = response_body(self._model_name, self._id, self._request, self._created_at, "failed", self._output,
                             error=failure)
        return [self._event("response.failed", response=body)]

    # -- helpers --------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> SSEEvent:
        # Serialised now: the items are mutated by later deltas, the event must show them as they are.
        data = {"type": kind, "sequence_number": self._num_events, **fields}
        self._num_events += 1
        return SSEEvent(json.dumps(data, separators=(",", ":"), ensure_ascii=False), kind)

    def _item_id(self, prefix: str) -> str:
        return output_item_id(prefix, self._id, len(self._output))

    def _add(self, item: dict[str, Any]) -> list[SSEEvent]:
        self._output.append(item)
        self._open = item["type"]
        return [self._event("response.output_item.added", output_index=len(self._output) - 1, item=item)]

    def _text(self, delta: TextDelta | ReasoningDelta) -> list[SSEEvent]:
        kind = "reasoning" if isinstance(delta, ReasoningDelta) else "message"
        events: list[SSEEvent] = []
        if self._open != kind:
            events = self._close("completed")
            if kind == "reasoning":
                events += self._add({"type": "reasoning", "id": self._item_id("rs"), "summary": [], "content": []})
                part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
                if self._summarizes:
                    self._output[-1]["summary"].append({"type": "summary_text", "text": ""})
                    events.append(self._event("response.reasoning_summary_part.added", **self._summary_where(),
                                              part={"type": "summary_text", "text": ""}))
            else:
                events += self._add({"type": "message", "id": self._item_id("msg"), "status": "in_progress",
                                     "role": "assistant", "content": []})
                part = {"type": "output_text", "text": "", "annotations": []}
            events.append(self._event("response.content_part.added", **self._where(), part=part))
            self._output[-1]["content"].append(part)
        self._output[-1]["content"][0]["text"] += delta.text
        if kind == "reasoning":
            events.append(self._event("response.reasoning_text.delta", **self._where(), delta=delta.text))
            if self._summarizes:
                self._output[-1]["summary"][0]["text"] += delta.text
                events.append(self._event("response.reasoning_summary_text.delta", **self._summary_where(),
                                          delta=delta.text))
            return events
        return events + [self._event("response.output_text.delta", **self._where(), delta=delta.text, logprobs=[])]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._output[-1]["id"], "output_index": len(self._output) - 1, "content_index": 0}

    def _summary_where(self) -> dict[str, Any]:
        return {"item_id": self._output[-1]["id"], "output_index": len(self._output) - 1, "summary_index": 0}

    def _close(self, status: str) -> list[SSEEvent]:
        """The done events of the item still open, which ends with `status` (completed | incomplete)."""
        if self._open is None:
            return []
        item, kind, self._open = self._output[-1], self._open, None
        index = len(self._output) - 1
        if kind == "function_call":
            events = [self._event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, arguments=item["arguments"])]
        elif kind == "custom_tool_call":
            item["input"] = custom_input(self._custom_arguments[index])
            events = [self._event("response.custom_tool_call_input.delta", item_id=item["id"], output_index=index,
                                  delta=item["input"]),
                      self._event("response.custom_tool_call_input.done", item_id=item["id"], output_index=index,
                                  input=item["input"])]
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
            events = [self._event(done, **self._where(), text=part["text"],
                                  **({} if kind == "reasoning" else {"logprobs": []})),
                      self._event("response.content_part.done", **self._where(), part=part)]
            if kind == "reasoning":
                item = self._output[index] = reasoning_item(item["id"], self._request, part["text"])
                if self._summarizes:
                    summary = item["summary"][0]
                    events += [self._event("response.reasoning_summary_text.done", **self._summary_where(),
                                           text=summary["text"]),
                               self._event("response.reasoning_summary_part.done", **self._summary_where(),
                                           part=summary)]
        if "status" in item:
            item["status"] = status
        return events + [self._event("response.output_item.done", output_index=len(self._output) - 1, item=item)]
