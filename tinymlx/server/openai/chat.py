"""OpenAI chat messages, tools and tool_choice -> a ChatTurn (the form every wire format shares).

    {"role": "assistant", "content": null, "tool_calls": [{"id", "type": "function",
                                                           "function": {"name", "arguments": "<json>"}}]}
    {"role": "tool", "tool_call_id": "...", "content": "..."}

A tool message takes its function's name from the call it answers, which must be an earlier one.
Content is a string or a list of parts: {"type": "text", "text"} and {"type": "image_url", "image_url":
{"url": "data:image/png;base64,..." | "https://..."}} (the url may be the value itself), in order.
"""

from __future__ import annotations

from typing import Any

from tinymlx.core.images import ImageData
from tinymlx.server.image_parts import image_of_url
from tinymlx.turns.api_error import APIError
from tinymlx.turns.tool_list import check_unique, named_choice, tool_of
from tinymlx.turns.turn import ChatTurn, Message, Tool, ToolCall, message_content

ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_turn(messages: list[dict[str, Any]], tools: list[Any] | None, tool_choice: Any,
              parallel_tool_calls: bool, template_kwargs: dict[str, Any] | None) -> ChatTurn:
    offered = openai_tools(tools or [])
    return ChatTurn(tuple(_messages(messages)), offered, openai_tool_choice(tool_choice, offered),
                    parallel_tool_calls, dict(template_kwargs or {}))


def openai_tools(tools: list[Any], field: str = "tools") -> tuple[Tool, ...]:
    """OpenAI's [{"type": "function", "function": {"name", "description", "parameters"}}]."""
    parsed = []
    for i, tool in enumerate(tools):
        where = f"{field}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise APIError(400, f"{where}: only function tools are supported: "
                                '{"type": "function", "function": {"name", "parameters"}}', field)
        function = tool["function"]
        parsed.append(tool_of(function.get("name"), function.get("description"),
                              function.get("parameters"), f"{where}.function", field))
    return check_unique(parsed, field)






def openai_tool_choice(choice: Any, tools: tuple[Tool, ...], field: str = "tool_choice") -> str:
    """"auto" | "none" | "required" | {"type": "function", "function": {"name"}} -> ChatTurn's form."""
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise APIError(400, "tool_choice 'required' needs tools", field)
        return choice
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else choice.get("name")
    if not isinstance(name, str):
        raise APIError(400, f"{field} must be 'auto', 'none', 'required' or "
                            f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}', field)
    return named_choice(name, tools, field)




def _messages(messages: list[dict[str, Any]]) -> list[Message]:
    parsed: list[Message] = []
    names_of_calls: dict[str, str] = {}
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(400, f"{where} must be an object", where)
        role = message.get("role")
        if role not in ROLES:
            raise APIError(400, f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        calls = tuple(_tool_calls(message.get("tool_calls"), where)) if role == "assistant" else ()
        content = message.get("content")
        if content is None and not calls:
            raise APIError(400, f"{where}.content must be a string or a list of text and image_url parts",
                           f"{where}.content")
        content = _content(content, f"{where}.content")
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in names_of_calls:
                raise APIError(400, f"{where}.tool_call_id {call_id!r} answers no earlier assistant tool call",
                               f"{where}.tool_call_id")
            parsed.append(Message("tool", **content, tool_call_id=call_id, name=names_of_calls[call_id]))
            continue
        for call in calls:
            names_of_calls[call.id] = call.name
        parsed.append(Message("system" if role == "developer" else role, **content,
                              reasoning=reasoning if role == "assistant" and isinstance(reasoning, str) else None,
                              tool_calls=calls))
    return parsed


def _tool_calls(calls: Any, where: str) -> list[ToolCall]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise APIError(400, f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    parsed = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(call.get("id"), str) or not isinstance(function.get("arguments", "{}"), str):
            raise APIError(400, f"{where}.tool_calls[{j}] must be "
                                '{"id", "type": "function", "function": {"name", "arguments": "<json text>"}}',
                           f"{where}.tool_calls")
        parsed.append(ToolCall(call["id"], function["name"], function.get("arguments", "{}")))
    return parsed


def _content(content: Any, where: str) -> dict[str, Any]:
    """Message's content (and parts, where it holds images): a string, or text and image_url parts in order;
    other parts (input_audio, file) are refused by name."""
    if content is None or isinstance(content, str):
        return {"content": content or ""}
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of text and image_url parts", where)
    parts: list[str | ImageData] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise APIError(400, f"{where}[{j}].text must be a string", f"{where}[{j}].text")
            parts.append(part["text"])
        elif kind == "image_url":
            url = part.get("image_url")
            parts.append(image_of_url(url.get("url") if isinstance(url, dict) else url, f"{where}[{j}]"))
        else:
            raise APIError(400, f"{where}[{j}]: parts of type {kind!r} are not supported; send text or image_url "
                                "parts", f"{where}[{j}]")
    return message_content(parts)
