"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens) as a WireFormat.

    {"model", "max_tokens", "system", "messages": [{"role": "user" | "assistant", "content": str | blocks}],
     "tools": [{"name", "description", "input_schema"}], "tool_choice", "thinking", "stop_sequences", ...}
      -> TurnRequest                                             parse()
    TurnResult -> {"type": "message", "content": [thinking, text, tool_use...], "stop_reason", "usage"}
    TurnEvents -> message_start, ping, (content_block_start, content_block_delta*, content_block_stop)*,
                  message_delta (stop_reason, usage), message_stop

Blocks become Messages the same way every turn, so an earlier turn re-renders byte-identically:
tool_use -> the assistant's tool_calls (input as json.dumps), thinking -> its reasoning, tool_result ->
a "tool" message named after the call it answers, placed before the user's text. Anthropic clients
authenticate with `x-api-key` (the server checks it against --api-key). Fields that only steer
Anthropic's own service (cache_control, service_tier, output_config.effort, ...) are ignored;
thinking.budget_tokens is not enforced: max_tokens bounds thinking and answer together.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tinymlx.sampling_params import SamplingParams
from tinymlx.server.api_error import APIError
from tinymlx.server.openai_chat import check_unique, named_choice
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

# Claude Code's first system block carries a per-request nonce (cch=...): kept, it would make every
# turn's prompt new from its first tokens and the prefix cache would never hit.
_BILLING_HEADER = "x-anthropic-billing-header:"
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 504: "timeout_error",
                529: "overloaded_error"}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_SAMPLING_FIELDS = {"stop": "stop_sequences", "json_schema": "output_config.format.schema"}  # ours -> Anthropic's


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class _Tool(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # server tools (bash_..., web_search_...) run at Anthropic, not here


class _ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class _Thinking(_Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None


class _MessageParam(_Strict):
    role: Literal["user", "assistant"]
    content: Any  # a string or blocks, checked block by block so an error names the block


class _Metadata(_Strict):
    user_id: str | None = None


class _OutputFormat(_Strict):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class _OutputConfig(_Strict):
    format: _OutputFormat | None = None


class _CountBody(_Strict):
    """What both endpoints read: the conversation and its tools."""

    model: str
    messages: list[_MessageParam] = Field(min_length=1)
    system: Any = None  # a string or text blocks
    tools: list[_Tool] | None = None
    tool_choice: _ToolChoice | None = None
    thinking: _Thinking | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # not Anthropic's: vLLM's, e.g. {"enable_thinking": false}


class _Body(_CountBody):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: _Metadata | None = None
    output_config: _OutputConfig | None = None
    output_format: _OutputFormat | None = None  # the structured-outputs beta's name for output_config.format


class _TextBlock(_Strict):
    type: Literal["text"]
    text: str


class _ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str


class _RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]  # Anthropic's encrypted thinking: nothing a template can show
    data: str


class _ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class _ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Any = ""  # a string or text blocks
    is_error: bool = False  # templates have no place for it; clients put the error in the content


_BLOCKS = {"text": _TextBlock, "thinking": _ThinkingBlock, "redacted_thinking": _RedactedThinkingBlock,
           "tool_use": _ToolUseBlock, "tool_result": _ToolResultBlock}
_ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "thinking", "redacted_thinking", "tool_use")}


class AnthropicMessages:
    name = "messages"
    id_prefix = "msg"

    def __init__(self, model_name: str):
        self.model_name = model_name

    # -- requests ---------------------------------------------------------------------------------
    def parse(self, body: dict[str, Any]) -> TurnRequest:
        request = _validated(_Body, body)
        turn = self._turn(request)
        sampling = {name: value for name, value in (("temperature", request.temperature), ("top_p", request.top_p),
                                                    ("top_k", request.top_k), ("stop", request.stop_sequences))
                    if value is not None}  # what the body left out takes the server's default
        constraint = _constraint(request)
        try:
            SamplingParams(max_tokens=request.max_tokens, **sampling, **constraint)
        except ValueError as error:  # SamplingParams names the field first: "top_p must be in ..."
            name, _, rest = str(error).partition(" ")
            field = _SAMPLING_FIELDS.get(name, name)
            raise APIError(400, f"{field} {rest}", field) from None
        user = request.metadata.user_id if request.metadata is not None else None
        return TurnRequest(self.model_name, turn, sampling, request.max_tokens, request.stream, user,
                           constraint=constraint)

    def parse_count(self, body: dict[str, Any]) -> ChatTurn:
        """/v1/messages/count_tokens: the turn alone; the server answers {"input_tokens": its prompt's length}."""
        return self._turn(_validated(_CountBody, body))

    def _turn(self, request: _CountBody) -> ChatTurn:
        if request.model != self.model_name:
            raise APIError(404, f"the model {request.model!r} does not exist; this server serves "
                                f"{self.model_name!r}", "model", "model_not_found")
        tools = check_unique([_tool(tool, f"tools[{i}]") for i, tool in enumerate(request.tools or [])], "tools")
        choice, parallel = _tool_choice(request.tool_choice, tools)
        template_kwargs: dict[str, Any] = {}
        if request.thinking is not None:
            if request.thinking.type == "enabled" and request.thinking.budget_tokens is None:
                raise APIError(400, "thinking.budget_tokens: Field required", "thinking.budget_tokens")
            template_kwargs["enable_thinking"] = request.thinking.type != "disabled"
        template_kwargs.update(request.chat_template_kwargs or {})
        messages = _system(request.system) + _messages(request.messages)
        return ChatTurn(tuple(messages), tools, choice, parallel, template_kwargs)

    # -- answers ----------------------------------------------------------------------------------
    def error_body(self, error: APIError) -> dict[str, Any]:
        return {"type": "error", "error": {"type": _error_type(error), "message": error.message}}

    def response(self, request_id: str, request: TurnRequest, result: TurnResult) -> dict[str, Any]:
        content: list[dict[str, Any]] = []
        if result.reasoning:
            content.append({"type": "thinking", "thinking": result.reasoning, "signature": ""})
        if result.text:
            content.append({"type": "text", "text": result.text})
        content += [{"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call.arguments)}
                    for call in result.tool_calls]
        stop_reason, stop_sequence = _stop(result)
        return {"id": request_id, "type": "message", "role": "assistant", "model": self.model_name,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": _usage(result.num_prompt_tokens, result.num_cached_tokens, result.num_completion_tokens)}

    def stream(self, request_id: str, request: TurnRequest) -> MessageStream:
        return MessageStream(self, request_id)


class MessageStream:
    """One reply's events. A content block stays open while events of its kind come; the next kind
    closes it (Anthropic's blocks never interleave), so block indexes count up from 0."""

    def __init__(self, wire: AnthropicMessages, request_id: str):
        self._wire, self._id = wire, request_id
        self._index = -1  # the latest block's index
        self._open: str | None = None  # the open block's type
        self._call: int | None = None  # the open tool_use block's call index (ToolCallStart.index)

    def start(self, num_prompt_tokens: int = 0, num_cached_tokens: int = 0) -> list[SSEEvent]:
        """The prompt's counts are optional: message_delta repeats usage in full, as the API's does."""
        message = {"id": self._id, "type": "message", "role": "assistant", "model": self._wire.model_name,
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
        return [_sse(self._wire.error_body(error))]

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


# -- requests: blocks -> Messages ----------------------------------------------------------------
def _tool(tool: _Tool, where: str) -> Tool:
    if tool.input_schema.get("type") != "object":
        raise APIError(400, f"{where}.input_schema must be a JSON schema of type 'object'", f"{where}.input_schema",
                       "invalid_tool_schema")
    return Tool(tool.name, tool.description or "", tool.input_schema)


def _tool_choice(choice: _ToolChoice | None, tools: tuple[Tool, ...]) -> tuple[str, bool]:
    if choice is None:
        return "auto", True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if choice.name is None:
            raise APIError(400, "tool_choice.name: Field required when type is 'tool'", "tool_choice.name")
        return named_choice(choice.name, tools, "tool_choice.name"), parallel
    if choice.type == "any" and not tools:
        raise APIError(400, "tool_choice 'any' needs tools", "tool_choice")
    return _TOOL_CHOICES[choice.type], parallel


def _system(system: Any) -> list[Message]:
    if system is None:
        return []
    if isinstance(system, str):
        text = system
    elif isinstance(system, list):
        texts = (_validated(_TextBlock, _only_text(block, f"system[{i}]"), f"system[{i}]").text
                 for i, block in enumerate(system))
        text = "\n".join(t for t in texts if not t.startswith(_BILLING_HEADER))
    else:
        raise APIError(400, "system must be a string or a list of text blocks", "system")
    return [Message("system", text)] if text else []


def _messages(params: list[_MessageParam]) -> list[Message]:
    messages: list[Message] = []
    names: dict[str, str] = {}  # tool_use id -> its tool's name, from the turns so far
    for i, param in enumerate(params):
        where = f"messages[{i}].content"
        blocks = _blocks(param.content, param.role, where)
        if param.role == "assistant":
            calls = tuple(ToolCall(b.id, b.name, json.dumps(b.input, ensure_ascii=False))
                          for b in blocks if isinstance(b, _ToolUseBlock))
            names.update((call.id, call.name) for call in calls)
            thinking = [b.thinking for b in blocks if isinstance(b, _ThinkingBlock)]
            # Our replies' text blocks are pieces of one generated text: they join back with nothing between.
            messages.append(Message("assistant", "".join(b.text for b in blocks if isinstance(b, _TextBlock)),
                                    "".join(thinking) if thinking else None, calls))
            continue
        results = []
        for j, block in enumerate(blocks):
            if isinstance(block, _ToolResultBlock):
                if block.tool_use_id not in names:
                    raise APIError(400, f"{where}[{j}].tool_use_id {block.tool_use_id!r} answers no earlier "
                                        "tool_use block", f"{where}[{j}].tool_use_id")
                text = _result_text(block.content, f"{where}[{j}].content")
                results.append(Message("tool", text, tool_call_id=block.tool_use_id, name=names[block.tool_use_id]))
        text = "\n".join(b.text for b in blocks if isinstance(b, _TextBlock))
        messages += results + ([Message("user", text)] if text or not results else [])
    return messages


def _blocks(content: Any, role: str, where: str) -> list[BaseModel]:
    if isinstance(content, str):
        return [_TextBlock(type="text", text=content)]
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content blocks", where)
    blocks = []
    for j, block in enumerate(content):
        kind = _kind(block, f"{where}[{j}]")
        if kind not in _ROLE_BLOCKS[role]:
            raise APIError(400, f"{where}[{j}].type: blocks of role {role!r} must be "
                                f"{', '.join(_ROLE_BLOCKS[role])}; got {kind!r}", f"{where}[{j}].type")
        blocks.append(_validated(_BLOCKS[kind], block, f"{where}[{j}]"))
    return blocks


def _result_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text blocks", where)
    return "\n".join(_validated(_TextBlock, _only_text(block, f"{where}[{k}]"), f"{where}[{k}]").text
                     for k, block in enumerate(content))


def _only_text(block: Any, where: str) -> Any:
    if _kind(block, where) != "text":
        raise APIError(400, f"{where}.type: only text blocks are allowed here, got {block.get('type')!r}",
                       f"{where}.type")
    return block


def _kind(block: Any, where: str) -> Any:
    """The block's type; images and documents are refused by name (this server's models read text)."""
    if not isinstance(block, dict):
        raise APIError(400, f"{where} must be a content block object", where)
    kind = block.get("type")
    if kind in ("image", "document"):
        raise APIError(400, f"{where}.type: {kind}s are not supported (this server's models read text only)",
                       f"{where}.type")
    return kind


def _constraint(request: _Body) -> dict[str, Any]:
    config = request.output_config.format if request.output_config is not None else None
    if config is not None and request.output_format is not None:
        raise APIError(400, "output_format: give output_config.format or output_format, not both", "output_format")
    output_format = config or request.output_format
    return {"json_schema": output_format.json_schema} if output_format is not None else {}


def _validated(model: type[BaseModel], data: Any, where: str = "") -> Any:
    """The pydantic error as a 400 naming the field: "messages[1].content[0].tool_use_id: ..."."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = where
        for part in first["loc"]:
            param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else str(part)
        got = "" if first["type"] == "missing" else f", got {_short(first['input'])}"
        raise APIError(400, f"{param}: {first['msg']}{got}", param or None) from None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# -- answers --------------------------------------------------------------------------------------
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
