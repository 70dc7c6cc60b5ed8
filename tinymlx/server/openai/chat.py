"""OpenAI chat messages, tools and tool_choice -> a ChatTurn (the form every wire format shares).

    {"role": "assistant", "content": null, "tool_calls": [{"id", "type": "function",
                                                           "function": {"name", "arguments": "<json>"}}]}
    {"role": "tool", "tool_call_id": "...", "content": "..."}

A tool message takes its function's name from the call it answers, which must be an earlier one.
"""

from __future__ import annotations

from typing import Any

from tinymlx.chat.api_error import APIError
from tinymlx.chat.tool_list import check_unique, named_choice, tool_of
from tinymlx.chat.turns import ChatTurn, Message, Tool, ToolCall

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
            raise APIError(400, f"{where}.content must be a string or a list of text parts", f"{where}.content")
        text = _text(content, f"{where}.content")
        reasoning = message.get("reasoning_content", message.get("reasoning"))
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in names_of_calls:
                raise APIError(400, f"{where}.tool_call_id {call_id!r} answers no earlier assistant tool call",
                               f"{where}.tool_call_id")
            parsed.append(Message("tool", text, tool_call_id=call_id, name=names_of_calls[call_id]))
            continue
        for call in calls:
            names_of_calls[call.id] = call.name
        parsed.append(Message("system" if role == "developer" else role, text,
                              reasoning if role == "assistant" and isinstance(reasoning, str) else None, calls))
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


def _text(content: Any, where: str) -> str:
    """A string, or text parts joined; anything else (images, audio) is refused by name."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    kinds = sorted({p.get("type", "?") for p in content if isinstance(p, dict)}) if isinstance(content, list) else []
    raise APIError(400, f"{where}: only text is supported (got {kinds or type(content).__name__})", where)
