"""The Responses API's input items -> Messages.

    "text" | {"type": "message", role, content}  Message(role, text)             (developer -> system)
    {"type": "reasoning", ...}                   .reasoning of the next assistant Message: the text sealed
                                                 in encrypted_content (ours, see sealed_reasoning.py),
                                                 else its content, else its summary
    {"type": "function_call" | "custom_tool_call", ...} x n
                                                 one assistant Message with n tool_calls (after its text);
                                                 a namespace's call under its flattened name, a custom
                                                 tool's input as the arguments {"input": ...}
    {"type": "function_call_output" | "custom_tool_call_output", ...}
                                                 Message("tool", tool_call_id, name of the call it answers);
                                                 without a call_id (context Codex adds), by its own name
    {"type": "additional_tools", "tools": [...]}  no Message: its tools join the request's (additional_tools())

A message's content (and a tool output given as a list) is text parts and {"type": "input_image", "image_url":
"data:..." | "https://..."} in order; input_file, input_audio and an image by file_id are refused by name.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Literal

from tinymlx.core.images import ImageData
from tinymlx.server.image_parts import image_of_url
from tinymlx.server.responses.sealed_reasoning import unseal
from tinymlx.server.responses.tools import flat_name
from tinymlx.server.strict_model import StrictModel, validated
from tinymlx.turns.api_error import APIError
from tinymlx.turns.tool_schema import json_text
from tinymlx.turns.turn import Message, ToolCall, message_content


class _MessageItem(StrictModel):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Any]


class _FunctionCallItem(StrictModel):
    call_id: str
    name: str
    arguments: str
    namespace: str | None = None


class _CustomToolCallItem(StrictModel):
    call_id: str
    name: str
    input: str
    namespace: str | None = None


class _FunctionCallOutputItem(StrictModel):
    call_id: str | None = None  # None: context a client adds as a tool's output (Codex's goal), by name
    name: str | None = None
    namespace: str | None = None
    output: str | list[Any]


class _Part(StrictModel):
    type: str
    text: str


class _ImagePart(StrictModel):
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None  # the processor's max_image_pixels decides


class _ReasoningItem(StrictModel):
    summary: list[_Part] = []
    content: list[_Part] | None = None
    encrypted_content: str | None = None


def input_messages(items: str | list[Any], earlier: tuple[Message, ...]) -> tuple[Message, ...]:
    """`input` as Messages; `earlier` (a chained response's conversation) names the calls it answers."""
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
            text = _reasoning_text(validated(_ReasoningItem, item, where), where)
            if text:
                flush()
                reasoning = text
        elif kind in ("function_call", "custom_tool_call"):
            call = _call(item, kind, where)
            names_of_calls[call.id] = call.name
            if reasoning is None and messages and messages[-1].role == "assistant":
                messages[-1] = replace(messages[-1], tool_calls=messages[-1].tool_calls + (call,))
            else:
                messages.append(Message("assistant", "", reasoning, (call,)))
                reasoning = None
        elif kind == "additional_tools":
            continue  # read by additional_tools()
        elif kind in ("function_call_output", "custom_tool_call_output"):
            flush()
            output = validated(_FunctionCallOutputItem, item, where)
            if output.call_id is None and output.name is None:
                raise APIError(400, f"{where}: a tool output needs the call_id of the call it answers, or the "
                                    "name of the tool it comes from", f"{where}.call_id")
            if output.call_id is not None and output.call_id not in names_of_calls:
                raise APIError(400, f"{where}.call_id {output.call_id!r} answers no earlier function_call",
                               f"{where}.call_id")
            name = names_of_calls[output.call_id] if output.call_id is not None else \
                flat_name(output.name or "", output.namespace)
            messages.append(Message("tool", **_content(output.output, f"{where}.output"),
                                    tool_call_id=output.call_id, name=name))
        elif kind == "message":
            message = validated(_MessageItem, item, where)
            content = _content(message.content, f"{where}.content")
            if message.role == "assistant":
                messages.append(Message("assistant", **content, reasoning=reasoning))
                reasoning = None
            else:
                flush()
                messages.append(Message("system" if message.role == "developer" else message.role, **content))
        else:
            raise APIError(400, f"{where}.type {kind!r} is not supported; use message, function_call, "
                                "function_call_output, custom_tool_call, custom_tool_call_output, reasoning or "
                                "additional_tools", f"{where}.type")
    flush()
    return tuple(messages)


class _AdditionalToolsItem(StrictModel):
    tools: list[Any]


def additional_tools(items: str | list[Any]) -> list[Any]:
    """The tools `additional_tools` items add (Codex gives a sub-agent its tools so), in order."""
    if isinstance(items, str):
        return []
    return [tool for i, item in enumerate(items) if isinstance(item, dict) and item.get("type") == "additional_tools"
            for tool in validated(_AdditionalToolsItem, item, f"input[{i}]").tools]


def _content(content: str | list[Any], where: str) -> dict[str, Any]:
    """Message's content (and parts, where it holds images): a string, or text and input_image parts in order;
    files and audio are refused by name."""
    if isinstance(content, str):
        return {"content": content}
    parts: list[str | ImageData] = []
    for j, raw in enumerate(content):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind == "input_image":
            parts.append(_image(validated(_ImagePart, raw, f"{where}[{j}]"), f"{where}[{j}]"))
            continue
        if kind in ("input_file", "input_audio"):
            raise APIError(400, f"{where}[{j}]: {kind} is not supported; this server reads text and images",
                           f"{where}[{j}].type")
        if kind == "refusal" and isinstance(raw.get("refusal"), str):
            parts.append(raw["refusal"])
            continue
        if kind not in ("input_text", "output_text"):
            raise APIError(400, f"{where}[{j}] must be an input_text, output_text or input_image part, got "
                                f"{kind!r}", f"{where}[{j}].type")
        parts.append(validated(_Part, raw, f"{where}[{j}]").text)
    return message_content(parts)


def _image(part: _ImagePart, where: str) -> ImageData:
    if part.image_url is None:
        if part.file_id is not None:
            raise APIError(400, f"{where}.file_id: images by file id are not supported (this server has no Files "
                                "API); send image_url as a data: or http(s) URL", f"{where}.file_id")
        raise APIError(400, f"{where}.image_url: Field required", f"{where}.image_url")
    return image_of_url(part.image_url, where)


def _call(item: dict[str, Any], kind: str, where: str) -> ToolCall:
    if kind == "function_call":
        function = validated(_FunctionCallItem, item, where)
        return ToolCall(function.call_id, flat_name(function.name, function.namespace), function.arguments)
    custom = validated(_CustomToolCallItem, item, where)
    return ToolCall(custom.call_id, flat_name(custom.name, custom.namespace), json_text({"input": custom.input}))


def _reasoning_text(item: _ReasoningItem, where: str) -> str | None:
    if item.encrypted_content:
        return unseal(item.encrypted_content, f"{where}.encrypted_content") or None
    if item.content:
        return "".join(part.text for part in item.content) or None
    return "\n\n".join(part.text for part in item.summary) or None
