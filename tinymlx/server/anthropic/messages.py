"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens) as a WireFormat.

    {"model", "max_tokens", "system", "messages": [{"role": "user" | "assistant", "content": str | blocks}],
     "tools": [{"name", "description", "input_schema"}], "tool_choice", "thinking", "stop_sequences", ...}
      -> TurnRequest                                             parse(), here
         the system and messages' blocks -> Messages             anthropic_blocks.py
    TurnResult, TurnEvents -> the Message object, its events     anthropic_reply.py

Anthropic clients authenticate with `x-api-key` (the server checks it against --api-key). Fields that
only steer Anthropic's own service (cache_control, service_tier, ...) are ignored; output_config.effort
reaches the template as reasoning_effort ("max" as "high"), which gpt-oss's reads;
thinking.budget_tokens is not enforced: max_tokens bounds thinking and answer together.

Tools with `defer_loading` are left out of the prompt and the call grammar, as Anthropic's tool search
keeps them out until a search loads them: a tool_reference block naming one in a tool result (Claude
Code's ToolSearch answers so) puts its definition there and makes it callable from then on. `context_management`'s
clear_thinking edit drops the thinking of all but the last `keep` thinking turns from the prompt;
clear_tool_uses is accepted and not applied (every tool result is rendered).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from tinymlx.core.sampling_params import SamplingParams
from tinymlx.server.anthropic.blocks import (
    MessageParam,
    ToolSearch,
    system_messages,
    turn_messages,
    without_old_thinking,
)
from tinymlx.server.anthropic.reply import MessageStream, error_body, message_body
from tinymlx.server.served_models import ServedModels
from tinymlx.server.strict_model import StrictModel, short_repr, validated
from tinymlx.turns.api_error import APIError
from tinymlx.turns.tool_list import check_unique, named_choice
from tinymlx.turns.turn import ChatTurn, Tool, TurnRequest, TurnResult

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_SAMPLING_FIELDS = {"stop": "stop_sequences", "json_schema": "output_config.format.schema"}  # ours -> Anthropic's


class _Tool(StrictModel):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # server tools (bash_..., web_search_...) run at Anthropic, not here
    defer_loading: bool = False


class _KeepTurns(StrictModel):
    type: Literal["thinking_turns"]
    value: int = Field(ge=0)


class _ContextEdit(StrictModel):
    type: str  # clear_thinking_20251015, clear_tool_uses_20250919, ...
    keep: Literal["all"] | _KeepTurns | dict[str, Any] | None = None


class _ContextManagement(StrictModel):
    edits: list[_ContextEdit] = []


class _ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class _Thinking(StrictModel):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None


class _Metadata(StrictModel):
    user_id: str | None = None


class _OutputFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class _OutputConfig(StrictModel):
    format: _OutputFormat | None = None
    effort: Literal["low", "medium", "high", "max"] | None = None


class _CountBody(StrictModel):
    """What both endpoints read: the conversation and its tools."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: Any = None  # a string or text blocks
    tools: list[_Tool] | None = None
    tool_choice: _ToolChoice | None = None
    thinking: _Thinking | None = None
    context_management: _ContextManagement | None = None
    output_config: _OutputConfig | None = None  # its effort shapes the prompt, so count_tokens reads it too
    chat_template_kwargs: dict[str, Any] | None = None  # not Anthropic's: vLLM's, e.g. {"enable_thinking": false}


class _Body(_CountBody):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: _Metadata | None = None
    output_format: _OutputFormat | None = None  # the structured-outputs beta's name for output_config.format


class AnthropicMessages:
    name = "messages"
    id_prefix = "msg"
    prompt_field = "messages"

    def __init__(self, served: ServedModels):
        self.served, self.model_name = served, served.name

    # -- requests ---------------------------------------------------------------------------------
    def parse(self, body: dict[str, Any]) -> TurnRequest:
        request = validated(_Body, body, shown=short_repr)
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
        return self._turn(validated(_CountBody, body, shown=short_repr))

    def _turn(self, request: _CountBody) -> ChatTurn:
        self.served.check(request.model)  # count_tokens too, which no other check sees
        every = [(_tool(tool, f"tools[{i}]"), tool.defer_loading) for i, tool in enumerate(request.tools or [])]
        check_unique([tool for tool, _ in every], "tools")
        tools = tuple(tool for tool, deferred in every if not deferred)
        search = ToolSearch(frozenset(tool.name for tool in tools), {t.name: t for t, deferred in every if deferred})
        template_kwargs: dict[str, Any] = {}
        if request.thinking is not None:
            if request.thinking.type == "enabled" and request.thinking.budget_tokens is None:
                raise APIError(400, "thinking.budget_tokens: Field required", "thinking.budget_tokens")
            template_kwargs["enable_thinking"] = request.thinking.type != "disabled"
        effort = request.output_config.effort if request.output_config is not None else None
        if effort is not None:
            template_kwargs["reasoning_effort"] = "high" if effort == "max" else effort
        template_kwargs.update(request.chat_template_kwargs or {})
        messages = system_messages(request.system) + turn_messages(request.messages, search)
        keep = _thinking_turns_kept(request.context_management)
        if keep is not None:
            messages = without_old_thinking(messages, keep)
        loaded = tuple(search.loaded)
        choice, parallel = _tool_choice(request.tool_choice, tools + loaded)
        return ChatTurn(tuple(messages), tools, choice, parallel, template_kwargs, loaded)

    # -- answers ----------------------------------------------------------------------------------
    def error_body(self, error: APIError) -> dict[str, Any]:
        return error_body(error)

    def response(self, request_id: str, request: TurnRequest, result: TurnResult) -> dict[str, Any]:
        return message_body(self.model_name, request_id, result)

    def stream(self, request_id: str, request: TurnRequest) -> MessageStream:
        return MessageStream(self.model_name, request_id)


# -- tools, tool_choice, context management, output format ----------------------------------------
def _thinking_turns_kept(management: _ContextManagement | None) -> int | None:
    """How many of the last thinking turns clear_thinking keeps; None: no clearing."""
    for i, edit in enumerate(management.edits if management is not None else []):
        if edit.type.startswith("clear_thinking"):
            if edit.keep == "all":
                return None
            if edit.keep is None:
                return 1  # Anthropic's default: the last thinking turn
            if isinstance(edit.keep, _KeepTurns):
                return edit.keep.value
            raise APIError(400, f"context_management.edits[{i}].keep must be 'all' or "
                                '{"type": "thinking_turns", "value": N}', f"context_management.edits[{i}].keep")
    return None


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


def _constraint(request: _Body) -> dict[str, Any]:
    config = request.output_config.format if request.output_config is not None else None
    if config is not None and request.output_format is not None:
        raise APIError(400, "output_format: give output_config.format or output_format, not both", "output_format")
    output_format = config or request.output_format
    return {"json_schema": output_format.json_schema} if output_format is not None else {}
