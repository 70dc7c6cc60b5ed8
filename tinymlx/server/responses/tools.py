"""The Responses API's `tools` and `tool_choice` -> the Tools a chat template renders.

    {"type": "function", name, parameters}    a Tool
    {"type": "custom", name, format}          a freeform Tool: {"input": raw text}, held to `format`'s
                                              lark or regex grammar by the call grammar
    {"type": "namespace", name, tools}        its tools flattened as "<namespace>__<name>" (Codex's own
                                              spelling when it talks chat/completions); calls go back
                                              under the tool's name with "namespace" set
    web_search, tool_search, local_shell...   hosted tools this server cannot run: left out of the
                                              prompt and logged; a tool_choice forcing one is a 400

`origins` maps each flattened or freeform Tool back to what the client sent, so the Response writes
its calls as the client expects: function_call with namespace, or custom_tool_call with input.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from tinymlx.server.strict_model import StrictModel, validated
from tinymlx.turns.api_error import APIError
from tinymlx.turns.tool_list import check_unique, named_choice, tool_of
from tinymlx.turns.turn import Freeform, Tool

log = logging.getLogger("tinymlx.server")

HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26", "file_search",
    "code_interpreter", "computer_use_preview", "computer_use", "image_generation", "local_shell", "shell", "mcp",
    "tool_search", "apply_patch",
})
NAMESPACE_SEPARATOR = "__"


@dataclass(frozen=True)
class ToolOrigin:
    name: str  # the name the client gave
    namespace: str | None = None
    custom: bool = False  # a freeform tool: its calls are custom_tool_call items


@dataclass(frozen=True)
class ResponsesTools:
    tools: tuple[Tool, ...] = ()
    origins: dict[str, ToolOrigin] = field(default_factory=dict)  # a Tool's name -> what the client sent
    echo: tuple[dict[str, Any], ...] = ()  # the tools as the Response repeats them


def flat_name(name: str, namespace: str | None) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


class _FunctionTool(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Format(StrictModel):
    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: str | None = None


class _CustomTool(StrictModel):
    name: str
    description: str | None = None
    format: _Format | None = None


class _Namespace(StrictModel):
    name: str
    description: str | None = None
    tools: list[dict[str, Any]]


def responses_tools(raw: list[Any]) -> ResponsesTools:
    tools: list[Tool] = []
    origins: dict[str, ToolOrigin] = {}
    left_out: list[str] = []
    echo: list[dict[str, Any]] = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in HOSTED_TOOLS:
            left_out.append(kind)
            continue
        if kind == "namespace":
            namespace = validated(_Namespace, tool, where)
            if not namespace.name or NAMESPACE_SEPARATOR in namespace.name:
                raise APIError(400, f"{where}.name must be a non-empty name without {NAMESPACE_SEPARATOR!r}",
                               f"{where}.name")
            if not namespace.tools:
                raise APIError(400, f"{where}.tools: the namespace {namespace.name!r} has no tools; give it at "
                                    "least one function or custom tool", f"{where}.tools")
            for j, inner in enumerate(namespace.tools):
                tools.append(_tool(inner, f"{where}.tools[{j}]", namespace.name, origins))
            echo.append(tool)
            continue
        tools.append(_tool(tool, where, None, origins))
        echo.append(_function_echo(tool) if kind == "function" else tool)
    if left_out:
        log.info("responses: left out hosted tools this server cannot run: %s", ", ".join(left_out))
    flattened = f" once namespaces are flattened to <namespace>{NAMESPACE_SEPARATOR}<name>"
    return ResponsesTools(check_unique(tools, "tools", flattened), origins, tuple(echo))


def _tool(tool: Any, where: str, namespace: str | None, origins: dict[str, ToolOrigin]) -> Tool:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind == "function":
        spec = validated(_FunctionTool, tool, where)
        parsed = tool_of(flat_name(spec.name, namespace), spec.description, spec.parameters, where, "tools")
        if namespace is not None:
            origins[parsed.name] = ToolOrigin(spec.name, namespace)
        return parsed
    if kind == "custom":
        custom = validated(_CustomTool, tool, where)
        if not custom.name:
            raise APIError(400, f"{where}.name must be a non-empty string", f"{where}.name")
        freeform = _freeform(custom.format, f"{where}.format")
        name = flat_name(custom.name, namespace)
        origins[name] = ToolOrigin(custom.name, namespace, custom=True)
        return Tool(name, custom.description or "", _input_schema(freeform), freeform)
    allowed = "function or custom" if namespace is not None else "function, custom, namespace or a hosted tool"
    raise APIError(400, f"{where}.type must be {allowed}, got {kind!r}", f"{where}.type")


def _freeform(spec: _Format | None, where: str) -> Freeform:
    if spec is None or spec.type == "text":
        return Freeform("text")
    if spec.syntax is None or not spec.definition:
        raise APIError(400, f"{where}: a grammar format needs a syntax (lark or regex) and a definition", where)
    return Freeform(spec.syntax, spec.definition)


def _input_schema(freeform: Freeform) -> dict[str, Any]:
    """What the chat template shows of a freeform tool: one string parameter, its grammar described."""
    if freeform.syntax == "text":
        description = "The tool's input: raw text."
    else:
        description = f"The tool's input: raw text in the language of this {freeform.syntax} grammar:\n" \
                      f"{freeform.definition}"
    return {"type": "object", "properties": {"input": {"type": "string", "description": description}},
            "required": ["input"]}


def _function_echo(raw: dict[str, Any]) -> dict[str, Any]:
    strict = raw.get("strict")
    return {"type": "function", "name": raw.get("name"), "description": raw.get("description"),
            "parameters": raw.get("parameters"),
            "strict": True if strict is None else strict}  # strict defaults to true in the Responses API


def responses_tool_choice(choice: str | dict[str, Any] | None, offered: ResponsesTools) -> tuple[str, Any]:
    """(ChatTurn's tool_choice, the form the Response echoes)."""
    if choice is None:
        return "auto", "auto"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not offered.tools:
            raise APIError(400, "tool_choice 'required' needs tools", "tool_choice")
        return choice, choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in HOSTED_TOOLS:
        raise APIError(400, f"tool_choice forces the hosted tool {kind!r}, which this server cannot run; "
                            "use 'auto' or name a function or custom tool", "tool_choice")
    if kind in ("function", "custom") and isinstance(choice.get("name"), str):
        name = named_choice(flat_name(choice["name"], choice.get("namespace")), offered.tools, "tool_choice")
        return name, choice
    raise APIError(400, "tool_choice must be 'auto', 'none', 'required' or "
                        f'{{"type": "function" | "custom", "name": ...}}, got {choice!r}', "tool_choice")
