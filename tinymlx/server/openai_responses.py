"""The OpenAI Responses API (POST /v1/responses, GET /v1/responses/{id}) as a WireFormat.

    input items                                 -> Messages
      "text" | {"type": "message", role, content}  Message(role, text)             (developer -> system)
      {"type": "reasoning", content | summary}     .reasoning of the next assistant Message
      {"type": "function_call", ...} x n           one assistant Message with n tool_calls (after its text)
      {"type": "function_call_output", ...}        Message("tool", tool_call_id, name of the call it answers)
    instructions                                -> a leading system message, not carried to the next response

Each stored response keeps its whole conversation: its input (its own previous_response_id expanded)
and its output as one assistant Message. A chain so re-renders every earlier turn the same bytes,
and turn k+1's prompt reuses turn k's blocks in the prefix cache.
"""

from __future__ import annotations

import copy
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tinymlx.sampling_params import SamplingParams
from tinymlx.server.openai_chat import check_unique, named_choice, tool_of
from tinymlx.server.protocol import APIError
from tinymlx.server.turns import (
    ChatTurn,
    Message,
    ReasoningDelta,
    SSEEvent,
    TextDelta,
    Tool,
    ToolArgumentsDelta,
    ToolCall,
    ToolCallEnd,
    ToolCallStart,
    TurnEvent,
    TurnRequest,
    TurnResult,
)


# -- the request body ---------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Format(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class _Text(_Strict):
    format: _Format | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class _Reasoning(_Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # echoed; a local model writes no summaries


class ResponsesRequest(_Strict):
    model: str
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    store: bool | None = None  # None: true, as OpenAI
    previous_response_id: str | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    text: _Text | None = None
    reasoning: _Reasoning | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # not OpenAI's: vLLM's, passed to the template
    # vLLM's sampling fields, beyond OpenAI's
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    priority: int | None = None
    # OpenAI's, not served: refused rather than ignored (include, truncation, prompt_cache_key are ignored)
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None


_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty", "seed", "stop", "stop_token_ids")


class _MessageItem(_Strict):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Any]


class _FunctionCallItem(_Strict):
    call_id: str
    name: str
    arguments: str


class _FunctionCallOutputItem(_Strict):
    call_id: str
    output: str | list[Any]


class _Part(_Strict):
    type: str
    text: str


class _ReasoningItem(_Strict):
    summary: list[_Part] = []
    content: list[_Part] | None = None


@dataclass
class ResponsesTurnRequest(TurnRequest):
    """A TurnRequest plus what the store needs and what the Response body repeats of the request."""

    history: tuple[Message, ...] = ()  # the conversation without the instructions: what a chained response inherits
    store: bool = True
    echo: dict[str, Any] = field(default_factory=dict)


class _Stored(NamedTuple):
    conversation: tuple[Message, ...]
    body: dict[str, Any]


# -- the wire format ----------------------------------------------------------------------------
class OpenAIResponses:
    name = "responses"
    id_prefix = "resp"

    def __init__(self, model_name: str, store_size: int = 256):
        self.model_name, self.store_size = model_name, store_size
        self._store: OrderedDict[str, _Stored] = OrderedDict()  # LRU: the most recently used last

    def parse(self, body: dict[str, Any]) -> ResponsesTurnRequest:
        request = _validate(ResponsesRequest, body)
        for name in ("conversation", "prompt"):
            if getattr(request, name) is not None:
                raise APIError(400, f"{name} is not supported; send the conversation as input", name)
        if request.background:
            raise APIError(400, "background responses are not supported", "background")
        if request.top_logprobs:
            raise APIError(400, "top_logprobs is not supported", "top_logprobs")
        earlier = self._stored(request.previous_response_id).conversation if request.previous_response_id else ()
        history = earlier + _input_messages(request.input, earlier)
        if not history:
            raise APIError(400, "input must not be empty", "input")
        tools = _tools(request.tools or [])
        choice, choice_echo = _tool_choice(request.tool_choice, tools)
        text = request.text or _Text()
        constraint = _constraint(text.format)
        sampling = {name: getattr(request, name) for name in _SAMPLING if getattr(request, name) is not None}
        _check_sampling(sampling, request.max_output_tokens, constraint)
        kwargs: dict[str, Any] = {}
        effort = request.reasoning.effort if request.reasoning else None
        if effort is not None:  # unset: the template's own default (Qwen3 thinks, Qwen2.5 cannot)
            kwargs["enable_thinking"] = effort != "none"
        kwargs.update(request.chat_template_kwargs or {})
        instructions = (Message("system", request.instructions),) if request.instructions is not None else ()
        parallel = request.parallel_tool_calls is not False
        store = request.store is not False
        echo = {
            "instructions": request.instructions, "previous_response_id": request.previous_response_id,
            "tools": [_tool_echo(tool, raw) for tool, raw in zip(tools, request.tools or [])],
            "tool_choice": choice_echo, "parallel_tool_calls": parallel, "temperature": request.temperature,
            "top_p": request.top_p, "max_output_tokens": request.max_output_tokens, "store": store,
            "text": {"format": (text.format.model_dump(by_alias=True, exclude_none=True) if text.format
                                else {"type": "text"}), "verbosity": text.verbosity},
            "reasoning": {"effort": effort, "summary": request.reasoning.summary if request.reasoning else None},
            "metadata": request.metadata or {}, "user": request.user, "truncation": "disabled", "background": False,
        }
        turn = ChatTurn(instructions + history, tools, choice, parallel, kwargs)
        return ResponsesTurnRequest(request.model, turn, sampling, max_tokens=request.max_output_tokens,
                                    stream=bool(request.stream), user=request.user, priority=request.priority or 0,
                                    constraint=constraint, history=history, store=store, echo=echo)

    def error_body(self, error: APIError) -> dict[str, Any]:
        return error.body()  # the Responses API answers errors in chat/completions' shape

    def response(self, request_id: str, request: TurnRequest, result: TurnResult) -> dict[str, Any]:
        now = int(time.time())
        return self._finished(request_id, request, result, _output_items(request_id, result), now)

    def stream(self, request_id: str, request: TurnRequest) -> _ResponsesStream:
        return _ResponsesStream(self, request_id, request)

    def get(self, response_id: str) -> dict[str, Any] | None:
        """The stored Response for GET /v1/responses/{id}; None: unknown, evicted or sent with store false."""
        if response_id not in self._store:
            return None
        self._store.move_to_end(response_id)
        return copy.deepcopy(self._store[response_id].body)

    def delete(self, response_id: str) -> bool:
        return self._store.pop(response_id, None) is not None

    # -- shared by response() and the stream ----------------------------------------------------
    def body(self, request_id: str, request: TurnRequest, created_at: int, status: str,
             output: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
        return {"id": request_id, "object": "response", "created_at": created_at, "status": status,
                "model": self.model_name, "output": output, "error": None, "incomplete_details": None,
                "usage": None, **_echo(request), **fields}

    def _finished(self, request_id: str, request: TurnRequest, result: TurnResult, output: list[dict[str, Any]],
                  created_at: int) -> dict[str, Any]:
        """The completed (or incomplete) Response, stored when the request asked for it."""
        status, incomplete = _status(result.finish_reason)
        body = self.body(request_id, request, created_at, status, output, incomplete_details=incomplete,
                         usage=_usage(result), completed_at=int(time.time()))
        history, store = _context(request)
        if store and self.store_size > 0:
            reply = Message("assistant", result.text, result.reasoning, tuple(result.tool_calls))
            self._store[request_id] = _Stored(history + (reply,), copy.deepcopy(body))
            self._store.move_to_end(request_id)
            while len(self._store) > self.store_size:
                self._store.popitem(last=False)
        return body

    def _stored(self, response_id: str) -> _Stored:
        if response_id not in self._store:
            raise APIError(404, f"Previous response with id '{response_id}' not found.", "previous_response_id",
                           "previous_response_not_found")
        self._store.move_to_end(response_id)
        return self._store[response_id]


# -- the stream ---------------------------------------------------------------------------------
class _ResponsesStream:
    """One streamed Response: each output item opens on its first delta and closes when the next opens.

    reasoning: output_item.added, content_part.added, reasoning_text.delta..., reasoning_text.done,
               content_part.done, output_item.done        (a message the same, with output_text.*)
    call:      output_item.added, function_call_arguments.delta..., function_call_arguments.done,
               output_item.done
    """

    def __init__(self, wire: OpenAIResponses, request_id: str, request: TurnRequest):
        self._wire, self._id, self._request = wire, request_id, request
        self._created_at = int(time.time())
        self._num_events = 0  # sequence_number of the next event
        self._output: list[dict[str, Any]] = []  # every item so far, in its latest state
        self._open: str | None = None  # the type of the last item while it still takes deltas
        self._calls: dict[int, int] = {}  # ToolCallStart.index -> output index
        self._started = False

    def start(self, num_prompt_tokens: int = 0, num_cached_tokens: int = 0) -> list[SSEEvent]:
        """The counts are not part of these events: usage comes with response.completed."""
        self._started = True
        body = self._wire.body(self._id, self._request, self._created_at, "in_progress", [])
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def event(self, event: TurnEvent) -> list[SSEEvent]:
        if isinstance(event, (TextDelta, ReasoningDelta)):
            return self._text(event) if event.text else []
        if isinstance(event, ToolCallStart):
            events = self._close("completed")
            self._calls[event.index] = len(self._output)
            return events + self._add(_call_item(self._item_id("fc"), ToolCall(event.id, event.name, ""),
                                                 "in_progress"))
        if isinstance(event, ToolArgumentsDelta):
            index = self._calls.get(event.index)
            if index is None:  # a delta of a call that never started: nothing to attach it to
                return []
            self._output[index]["arguments"] += event.text
            return [self._event("response.function_call_arguments.delta", item_id=self._output[index]["id"],
                                output_index=index, delta=event.text)] if event.text else []
        if isinstance(event, ToolCallEnd) and self._calls.get(event.index) == len(self._output) - 1:
            return self._close("completed")
        return []

    def finish(self, result: TurnResult) -> list[SSEEvent]:
        status, _ = _status(result.finish_reason)
        events = self._close(status)
        output = self._output or _output_items(self._id, result)  # a reply without deltas still has its items
        body = self._wire._finished(self._id, self._request, result, output, self._created_at)
        return events + [self._event(f"response.{status}", response=body)]

    def error(self, error: APIError) -> list[SSEEvent]:
        if not self._started:  # no Response exists yet for a response.failed to carry
            return [self._event("error", code=error.code, message=error.message, param=error.param)]
        if self._open is not None and "status" in self._output[-1]:
            self._output[-1]["status"] = "incomplete"
        failure = {"code": _failure_code(error), "message": error.message, "param": error.param,
                   "type": error.error_type}
        body = self._wire.body(self._id, self._request, self._created_at, "failed", self._output, error=failure)
        return [self._event("response.failed", response=body)]

    # -- helpers --------------------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> SSEEvent:
        # Serialised now: the items are mutated by later deltas, the event must show them as they are.
        data = {"type": kind, "sequence_number": self._num_events, **fields}
        self._num_events += 1
        return SSEEvent(json.dumps(data, separators=(",", ":"), ensure_ascii=False), kind)

    def _item_id(self, prefix: str) -> str:
        return _item_id(prefix, self._id, len(self._output))

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
            else:
                events += self._add({"type": "message", "id": self._item_id("msg"), "status": "in_progress",
                                     "role": "assistant", "content": []})
                part = {"type": "output_text", "text": "", "annotations": []}
            events.append(self._event("response.content_part.added", **self._where(), part=part))
            self._output[-1]["content"].append(part)
        self._output[-1]["content"][0]["text"] += delta.text
        if kind == "reasoning":
            return events + [self._event("response.reasoning_text.delta", **self._where(), delta=delta.text)]
        return events + [self._event("response.output_text.delta", **self._where(), delta=delta.text, logprobs=[])]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._output[-1]["id"], "output_index": len(self._output) - 1, "content_index": 0}

    def _close(self, status: str) -> list[SSEEvent]:
        """The done events of the item still open, which ends with `status` (completed | incomplete)."""
        if self._open is None:
            return []
        item, kind, self._open = self._output[-1], self._open, None
        if kind == "function_call":
            events = [self._event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=len(self._output) - 1, arguments=item["arguments"])]
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
            events = [self._event(done, **self._where(), text=part["text"],
                                  **({} if kind == "reasoning" else {"logprobs": []})),
                      self._event("response.content_part.done", **self._where(), part=part)]
        if "status" in item:
            item["status"] = status
        return events + [self._event("response.output_item.done", output_index=len(self._output) - 1, item=item)]


# -- input items -> Messages --------------------------------------------------------------------
def _input_messages(items: str | list[Any], earlier: tuple[Message, ...]) -> tuple[Message, ...]:
    if isinstance(items, str):
        return (Message("user", items),)
    names_of_calls = {call.id: call.name for message in earlier for call in message.tool_calls}
    messages: list[Message] = []
    reasoning: str | None = None  # waits for the assistant message it belongs to

    def flush() -> None:  # a reasoning-only reply (cut by max_output_tokens) is an assistant message too
        nonlocal reasoning
        if reasoning is not None:
            messages.append(Message("assistant", "", reasoning))
            reasoning = None

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(400, f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "reasoning":
            text = _reasoning_text(_validate(_ReasoningItem, item, where))
            if text:  # encrypted-only reasoning carries nothing this model can read
                flush()
                reasoning = text
        elif kind == "function_call":
            call_item = _validate(_FunctionCallItem, item, where)
            call = ToolCall(call_item.call_id, call_item.name, call_item.arguments)
            names_of_calls[call.id] = call.name
            if reasoning is None and messages and messages[-1].role == "assistant":
                messages[-1] = replace(messages[-1], tool_calls=messages[-1].tool_calls + (call,))
            else:
                messages.append(Message("assistant", "", reasoning, (call,)))
                reasoning = None
        elif kind == "function_call_output":
            flush()
            output = _validate(_FunctionCallOutputItem, item, where)
            if output.call_id not in names_of_calls:
                raise APIError(400, f"{where}.call_id {output.call_id!r} answers no earlier function_call",
                               f"{where}.call_id")
            messages.append(Message("tool", _text(output.output, f"{where}.output"), tool_call_id=output.call_id,
                                    name=names_of_calls[output.call_id]))
        elif kind == "message":
            message = _validate(_MessageItem, item, where)
            text = _text(message.content, f"{where}.content")
            if message.role == "assistant":
                messages.append(Message("assistant", text, reasoning))
                reasoning = None
            else:
                flush()
                messages.append(Message("system" if message.role == "developer" else message.role, text))
        else:
            raise APIError(400, f"{where}.type {kind!r} is not supported; use message, function_call, "
                                "function_call_output or reasoning", f"{where}.type")
    flush()
    return tuple(messages)


def _text(content: str | list[Any], where: str) -> str:
    """A string, or text parts joined; images, files and audio are refused by name."""
    if isinstance(content, str):
        return content
    texts = []
    for j, raw in enumerate(content):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise APIError(400, f"{where}[{j}]: {kind} is not supported; this server reads text only",
                           f"{where}[{j}].type")
        if kind == "refusal" and isinstance(raw.get("refusal"), str):
            texts.append(raw["refusal"])
            continue
        if kind not in ("input_text", "output_text"):
            raise APIError(400, f"{where}[{j}] must be an input_text or output_text part, got {kind!r}",
                           f"{where}[{j}].type")
        texts.append(_validate(_Part, raw, f"{where}[{j}]").text)
    return "".join(texts)


def _reasoning_text(item: _ReasoningItem) -> str | None:
    if item.content:
        return "".join(part.text for part in item.content) or None
    return "\n\n".join(part.text for part in item.summary) or None


# -- tools, tool_choice, text.format ------------------------------------------------------------
class _FunctionTool(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def _tools(raw: list[Any]) -> tuple[Tool, ...]:
    """Responses' flat {"type": "function", "name", "description", "parameters", "strict"}."""
    tools = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise APIError(400, f"{where}: only function tools are supported, got type {kind!r}", f"{where}.type")
        spec = _validate(_FunctionTool, tool, where)
        tools.append(tool_of(spec.name, spec.description, spec.parameters, where, "tools"))
    return check_unique(tools, "tools")


def _tool_echo(tool: Tool, raw: dict[str, Any]) -> dict[str, Any]:
    strict = raw.get("strict")
    return {"type": "function", "name": tool.name, "description": tool.description, "parameters": tool.parameters,
            "strict": True if strict is None else strict}  # strict defaults to true in the Responses API


def _tool_choice(choice: str | dict[str, Any] | None, tools: tuple[Tool, ...]) -> tuple[str, Any]:
    """(ChatTurn's tool_choice, the form the Response echoes)."""
    if choice is None:
        return "auto", "auto"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise APIError(400, "tool_choice 'required' needs tools", "tool_choice")
        return choice, choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        name = named_choice(choice["name"], tools, "tool_choice")
        return name, {"type": "function", "name": name}
    raise APIError(400, "tool_choice must be 'auto', 'none', 'required' or "
                        f'{{"type": "function", "name": ...}}, got {choice!r}', "tool_choice")


def _constraint(spec: _Format | None) -> dict[str, Any]:
    if spec is None or spec.type == "text":
        return {}
    if spec.type == "json_object":
        return {"json_object": True}
    if spec.name is None or spec.schema_ is None:
        raise APIError(400, "text.format of type json_schema needs a name and a schema", "text.format")
    return {"json_schema": spec.schema_}


def _check_sampling(sampling: dict[str, Any], max_tokens: int | None, constraint: dict[str, Any]) -> None:
    """A 400 now, naming this API's field, for what SamplingParams would refuse later."""
    try:
        SamplingParams(**sampling, **constraint, **({} if max_tokens is None else {"max_tokens": max_tokens}))
    except ValueError as error:  # SamplingParams names the field first: "top_p must be in ..."
        name = str(error).split(" ", 1)[0]
        param = "max_output_tokens" if name == "max_tokens" else name if name in sampling else "text.format"
        raise APIError(400, str(error), param) from None


# -- output -------------------------------------------------------------------------------------
def _item_id(prefix: str, request_id: str, index: int) -> str:
    base = request_id.removeprefix("resp_").removeprefix("resp-")
    return f"{prefix}_{base}_{index}"


def _call_item(item_id: str, call: ToolCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status}


def _output_items(request_id: str, result: TurnResult) -> list[dict[str, Any]]:
    """reasoning, then the message (always one when there are no calls), then each function call."""
    items: list[dict[str, Any]] = []
    if result.reasoning:
        items.append({"type": "reasoning", "id": _item_id("rs", request_id, 0), "summary": [],
                      "content": [{"type": "reasoning_text", "text": result.reasoning}]})
    if result.text or not result.tool_calls:
        items.append({"type": "message", "id": _item_id("msg", request_id, len(items)), "status": "completed",
                      "role": "assistant", "content": [{"type": "output_text", "text": result.text,
                                                        "annotations": []}]})
    for call in result.tool_calls:
        items.append(_call_item(_item_id("fc", request_id, len(items)), call, "completed"))
    if _status(result.finish_reason)[0] == "incomplete" and "status" in items[-1]:
        items[-1]["status"] = "incomplete"
    return items


def _status(finish_reason: str) -> tuple[str, dict[str, Any] | None]:
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


def _failure_code(error: APIError) -> str:
    """ResponseError.code is one of a fixed list; the APIError's own code stays in the message."""
    return {400: "invalid_prompt", 429: "rate_limit_exceeded"}.get(error.status, "server_error")


def _context(request: TurnRequest) -> tuple[tuple[Message, ...], bool]:
    """(the conversation a chained response inherits, whether to store): a plain TurnRequest keeps all."""
    if isinstance(request, ResponsesTurnRequest):
        return request.history, request.store
    return request.turn.messages, True


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


def _validate(model: type[BaseModel], data: Any, where: str = "") -> Any:
    """model.model_validate, a ValidationError made a 400 naming the field: "input[2].call_id"."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = where
        for part in first["loc"]:
            if isinstance(part, int):
                param += f"[{part}]"
            elif part not in _UNION_TAGS and "[" not in part:  # pydantic names a union's member in loc
                param += f".{part}" if param else part
        got = "" if first["type"] == "missing" else f", got {first['input']!r}"
        raise APIError(400, f"{param}: {first['msg']}{got}", param or None) from None


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}
