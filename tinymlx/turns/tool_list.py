"""A request's tools, read the same way for every wire format: each tool's fields checked, every name
its own, and a choice that names one of them."""

from __future__ import annotations

from typing import Any

from tinymlx.turns.api_error import APIError
from tinymlx.turns.turn import Tool


def tool_of(name: Any, description: Any, parameters: Any, where: str, field: str) -> Tool:
    if not isinstance(name, str) or not name:
        raise APIError(400, f"{where}.name must be a non-empty string", field)
    if description is not None and not isinstance(description, str):
        raise APIError(400, f"{where}.description must be a string", field)
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise APIError(400, f"{where}.parameters must be a JSON schema object", field)
    return Tool(name, description or "", parameters)


def check_unique(tools: list[Tool], field: str, when: str = "") -> tuple[Tool, ...]:
    """The tools, or a 400 naming the repeated names (`when` says at what point they must differ)."""
    names = [tool.name for tool in tools]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise APIError(400, f"{field}: each tool needs its own name{when}; repeated: {repeated}", field)
    return tuple(tools)


def named_choice(name: str, tools: tuple[Tool, ...], field: str) -> str:
    if name not in {tool.name for tool in tools}:
        raise APIError(400, f"{field} names the tool {name!r}, which is not among the request's tools "
                            f"{[tool.name for tool in tools]}", field)
    return name
