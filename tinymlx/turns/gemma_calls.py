"""Gemma 4's call syntax: its markup, its argument values read as JSON, and its call grammar.

    <|channel>thought\\nWhich tool?<channel|>                                   reasoning
    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>      a call

The arguments are an object in Gemma's own notation: keys bare, strings between `<|"|>` tokens (so a
string holds quotes, braces and commas as they are), numbers, true, false and null as in JSON, lists in
brackets, objects in braces. The chat template writes an earlier call's keys in sorted order, so the
grammar asks for them so too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from tinymlx.turns.turn import Tool

CALL_OPEN, CALL_CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
THOUGHT_OPEN, THOUGHT_CLOSE = "<|channel>thought", "<channel|>"
_HEAD = re.compile(r"\s*call:([^{\s]+)\{")
_KEY = re.compile(r"\s*([^:{}\[\],\s<]+)\s*:")
_INTEGER = r"-?(0|[1-9][0-9]*)"  # JSON's numbers, which the reader and the grammar both take
_NUMBER = re.compile(_INTEGER + r"(\.[0-9]+)?([eE][-+]?[0-9]+)?")
_LITERALS = {"true": True, "false": False, "null": None}
_EMPTY = '""'  # Lark's empty string: an optional member's alternative when nothing follows it


def is_gemma_template(chat_template_source: str) -> bool:
    return CALL_OPEN in chat_template_source and CALL_CLOSE in chat_template_source


def whole_gemma_call(text: str, tools: dict[str, Tool]) -> tuple[str, str] | None:
    """(name, JSON arguments) of a complete call's text (between its tags), or None if it is not a call of a tool."""
    head = _HEAD.match(text)
    if head is None or head.group(1) not in tools:
        return None
    try:
        arguments, end = _Values(text).object(head.end())
    except ValueError:
        return None
    return (head.group(1), json.dumps(arguments, ensure_ascii=False)) if not text[end:].strip() else None


class _Values:
    """A recursive-descent reader of Gemma's notation; ValueError where the text is not a value."""

    def __init__(self, text: str):
        self._text = text

    def object(self, at: int) -> tuple[dict[str, Any], int]:
        """The members after an opening "{" at `at`, up to and past its "}"."""
        members: dict[str, Any] = {}
        at = self._skip(at)
        if self._text.startswith("}", at):
            return members, at + 1
        while True:
            key = _KEY.match(self._text, at)
            if key is None:
                raise ValueError("a key expected")
            members[key.group(1)], at = self.value(key.end())
            at = self._skip(at)
            if self._text.startswith("}", at):
                return members, at + 1
            if not self._text.startswith(",", at):
                raise ValueError("',' or '}' expected")
            at += 1

    def value(self, at: int) -> tuple[Any, int]:
        at = self._skip(at)
        text = self._text
        if text.startswith(QUOTE, at):
            end = text.find(QUOTE, at + len(QUOTE))
            if end < 0:
                raise ValueError("an unclosed string")
            return text[at + len(QUOTE):end], end + len(QUOTE)
        if text.startswith("{", at):
            return self.object(at + 1)
        if text.startswith("[", at):
            items: list[Any] = []
            at = self._skip(at + 1)
            if text.startswith("]", at):
                return items, at + 1
            while True:
                item, at = self.value(at)
                items.append(item)
                at = self._skip(at)
                if text.startswith("]", at):
                    return items, at + 1
                if not text.startswith(",", at):
                    raise ValueError("',' or ']' expected")
                at += 1
        for word, literal in _LITERALS.items():
            if text.startswith(word, at):
                return literal, at + len(word)
        number = _NUMBER.match(text, at)
        if number is None:
            raise ValueError("a value expected")
        return json.loads(number.group(0)), number.end()

    def _skip(self, at: int) -> int:
        while at < len(self._text) and self._text[at].isspace():
            at += 1
        return at


def gemma_grammar(tools: Sequence[Tool], tool_choice: str, parallel: bool) -> str:
    """The Lark grammar of a Gemma 4 reply: an optional thought, then text (auto only) and calls. The markup
    is the vocabulary's control tokens."""
    rules = ["%llguidance {}", "TEXT: /(?s:.*)/", 'STRING: /(?s:.*)/',
             f'string: {QUOTE} STRING {QUOTE}', f"NUMBER: /{_NUMBER.pattern}/", f"INTEGER: /{_INTEGER}/",
             'any: string | NUMBER | "true" | "false" | "null" | "[" (any ("," any)*)? "]" '
             '| "{" (KEY ":" any ("," KEY ":" any)*)? "}"', "KEY: /[A-Za-z_][A-Za-z0-9_]*/",
             f'thought: {THOUGHT_OPEN.removesuffix("thought")} "thought" TEXT {THOUGHT_CLOSE}']
    builder = _Rules(rules)
    names = [f"fn{i}" for i in range(len(tools))]
    for name, tool in zip(names, tools):
        rules.append(f'{name}: {json.dumps(tool.name)} {builder.object(tool.parameters)}')
    rules.append(f'call: {CALL_OPEN} "call:" ({" | ".join(names)}) {CALL_CLOSE}')
    calls = "call+" if parallel and tool_choice in ("auto", "required") else "call"
    body = f"TEXT | TEXT? {calls}" if tool_choice == "auto" else calls
    rules.append(f"start: thought? ({body})")
    return "\n".join(rules) + "\n"


class _Rules:
    """Value rules from JSON schemas, named as they are made."""

    def __init__(self, rules: list[str]):
        self._rules = rules
        self._count = 0

    def _new(self, body: str) -> str:
        self._count += 1
        name = f"v{self._count}"
        self._rules.append(f"{name}: {body}")
        return name

    def value(self, schema: Any) -> str:
        if not isinstance(schema, dict):
            return "any"
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            return f'{QUOTE} ({" | ".join(json.dumps(v) for v in enum)}) {QUOTE}'
        kind = schema.get("type")
        if kind == "string":
            return "string"
        if kind == "integer":
            return "INTEGER"
        if kind == "number":
            return "NUMBER"
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "array":
            item = self.value(schema.get("items"))
            return self._new(f'"[" ({item} ("," {item})*)? "]"')
        if kind == "object" and isinstance(schema.get("properties"), dict):
            return self.object(schema)
        return "any"

    def object(self, schema: dict[str, Any]) -> str:
        """Its properties in sorted order, the required ones always there, each once; others not allowed
        (an object with no properties listed takes any members)."""
        properties = schema.get("properties")
        if not isinstance(properties, dict) or not properties:
            return '"{" (KEY ":" any ("," KEY ":" any)*)? "}"' if properties is None else '"{" "}"'
        required = set(schema.get("required") or ())
        keys = sorted(properties)
        members = [f'{json.dumps(key + ":")} {self.value(properties[key])}' for key in keys]
        # first_i: members from i on, none written yet; rest_i: some written, so each opens with ","
        first, rest = "", ""
        for i in range(len(keys) - 1, -1, -1):
            later_first, later_rest = first, rest
            rest = self._new(f'"," {members[i]} {later_rest}'.strip()
                             + ("" if keys[i] in required else f" | {later_rest or _EMPTY}"))
            first = self._new(f"{members[i]} {later_rest}".strip()
                              + ("" if keys[i] in required else f" | {later_first or _EMPTY}"))
        return f'"{{" {first} "}}"'
