"""One chat turn as the three chat wire formats share it: plain data between their parsers, the
engine and their encoders.

    wire request (chat/completions, /v1/messages, /v1/responses)
      -> TurnRequest (a ChatTurn + sampling fields)         each wire format's parser
      -> prompt ids (the chat template renders messages and tools), SamplingParams (+ the call grammar)
      -> RequestOutput deltas -> TurnEvents                 tool_calls.OutputParser (reasoning, calls)
      -> TurnResult at the end                              each wire format's encoder

Every wire format converts its history into `Message`s, so the chat template renders an earlier
turn the same bytes whichever API sent it: that is what lets turn k+1 reuse turn k's blocks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol

from tinymlx.core.images import ImageData
from tinymlx.turns.api_error import APIError

Role = Literal["system", "user", "assistant", "tool"]
# "auto": text or calls; "none": text only; "required": at least one call; a Tool's name: that call.
ToolChoice = str


@dataclass(frozen=True)
class Freeform:
    """A custom (freeform) tool's input: raw text in a grammar's language (the Responses API's `format`)."""

    syntax: Literal["lark", "regex", "text"]  # text: any text
    definition: str = ""


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # the JSON schema of the call's arguments (an object)
    # A freeform tool's calls carry {"input": <raw text>}: the call grammar holds the text to this.
    freeform: Freeform | None = None

    def template_dict(self) -> dict[str, Any]:
        """The form chat templates read: OpenAI's {"type": "function", "function": {...}}."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it

    def template_dict(self) -> dict[str, Any]:
        # Templates render the arguments with tojson, so they get the object, not its text.
        try:
            arguments = json.loads(self.arguments)
        except json.JSONDecodeError:
            arguments = self.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


@dataclass(frozen=True)
class Message:
    role: Role
    content: str = ""
    reasoning: str | None = None  # an assistant's thinking, when the client sent it back
    tool_calls: tuple[ToolCall, ...] = ()  # assistant only
    tool_call_id: str | None = None  # tool only: the call this is the result of
    name: str | None = None  # tool only: the function's name (some templates print it)
    # The content in order where it holds images: text and ImageData (`content` is its text alone).
    parts: tuple[str | ImageData, ...] = ()

    def template_dict(self) -> dict[str, Any]:
        content: Any = self.content
        if any(isinstance(part, ImageData) for part in self.parts):  # the engine's image intake reads these
            content = [{"type": "image", "image": part} if isinstance(part, ImageData) else {"type": "text", "text": part}
                       for part in self.parts]
        message: dict[str, Any] = {"role": self.role, "content": content}
        if self.reasoning is not None:  # under both names templates read: Qwen's, and gpt-oss's "thinking"
            message["reasoning_content"] = message["thinking"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message


@dataclass(frozen=True)
class ChatTurn:
    messages: tuple[Message, ...]
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs, e.g. enable_thinking
    # Tools a tool search loaded during the conversation (Anthropic's tool_reference): callable, but not
    # added to the prompt's tool list, whose tokens then stay those of the earlier turns; the tool result
    # that loaded each carries its definition.
    loaded_tools: tuple[Tool, ...] = ()

    @property
    def callable_tools(self) -> tuple[Tool, ...]:
        return self.tools + self.loaded_tools

    @property
    def offers_tools(self) -> bool:
        return bool(self.callable_tools) and self.tool_choice != "none"


@dataclass
class TurnRequest:
    """What a wire format's parser hands the server: the turn, and how to sample it."""

    model: str
    turn: ChatTurn
    sampling: dict[str, Any]  # SamplingParams fields the body set (temperature, top_p, stop, seed, ...)
    max_tokens: int | None = None  # None: what the context leaves
    stream: bool = False
    user: str | None = None
    priority: int = 0
    constraint: dict[str, Any] = field(default_factory=dict)  # SamplingParams' constraint field (text.format)


def message_content(parts: list[str | ImageData]) -> dict[str, Any]:
    """Message's content and parts for a wire format's content list: its text, and the parts where it holds
    an image."""
    text = "".join(part for part in parts if isinstance(part, str))
    return {"content": text, "parts": tuple(parts) if any(isinstance(p, ImageData) for p in parts) else ()}


# -- what the output parser makes of the generated text, in order -------------------------------
class TextDelta(NamedTuple):
    text: str


class ReasoningDelta(NamedTuple):
    text: str


class ToolCallStart(NamedTuple):
    index: int  # 0, 1, ... within the reply
    id: str
    name: str


class ToolArgumentsDelta(NamedTuple):
    index: int
    text: str  # the next piece of the call's JSON arguments; the pieces concatenate to ToolCall.arguments


class ToolCallEnd(NamedTuple):
    index: int


TurnEvent = TextDelta | ReasoningDelta | ToolCallStart | ToolArgumentsDelta | ToolCallEnd


@dataclass
class TurnResult:
    text: str
    reasoning: str | None
    tool_calls: list[ToolCall]
    finish_reason: str  # "stop" | "length" | "tool_calls" | "abort"
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int  # prompt tokens the prefix cache served
    stop_sequence: str | None = None  # the request's stop string that ended the reply, if one did


# -- what a wire format gives the server (chat/completions keeps its own path: it has n choices) ---
class SSEEvent(NamedTuple):
    data: str  # JSON text
    event: str | None = None  # the SSE `event:` name (Anthropic's and the Responses API's type)


class TurnStream(Protocol):
    """One streamed reply in a wire format's events, fed in order."""

    def start(self, num_prompt_tokens: int, num_cached_tokens: int) -> list[SSEEvent]: ...  # at the first token
    def event(self, event: TurnEvent) -> list[SSEEvent]: ...
    def finish(self, result: TurnResult) -> list[SSEEvent]: ...
    def error(self, error: APIError) -> list[SSEEvent]: ...  # the stream's last events after a failure


class WireFormat(Protocol):
    name: str  # the endpoint label in logs and metrics: "messages" | "responses"
    id_prefix: str  # "msg" | "resp"
    prompt_field: str  # the body's field an over-long prompt is blamed on: "messages" | "input"

    def parse(self, body: dict[str, Any]) -> TurnRequest: ...  # APIError (400/404) on a bad body
    def error_body(self, error: APIError) -> dict[str, Any]: ...  # the error in this API's own shape
    def response(self, request_id: str, request: TurnRequest, result: TurnResult) -> dict[str, Any]: ...
    def stream(self, request_id: str, request: TurnRequest) -> TurnStream: ...
