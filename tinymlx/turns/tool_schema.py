"""A tool's JSON schema read as far as call parsing needs it: which JSON types a parameter allows,
how an xml parameter's value is written, and its raw text read back as the value the schema types."""

from __future__ import annotations

import json
from typing import Any

from tinymlx.turns.turn import Tool


def json_text(value: Any) -> str:
    """Arguments as JSON text the way the parser writes them (json.dumps' separators, UTF-8 kept)."""
    return json.dumps(value, ensure_ascii=False)


def json_value(text: str) -> Any:
    """JSON text as a value: ValueError for what is not JSON, NaN and Infinity included."""
    return json.loads(text, parse_constant=_refuse)


def schema_types(schema: Any) -> set[str]:
    """The JSON types a (sub)schema allows, as far as its type / enum / const / anyOf say."""
    if not isinstance(schema, dict):
        return set()
    if isinstance(schema.get("type"), str):
        return {schema["type"]}
    if isinstance(schema.get("type"), list):
        return {t for t in schema["type"] if isinstance(t, str)}
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list) and values:
        return {_json_type(value) for value in values}
    members = schema.get("anyOf", schema.get("oneOf"))
    return set().union(*map(schema_types, members)) if isinstance(members, list) and members else set()


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}.get(type(value), "null")


def xml_value_kind(schema: Any) -> str:
    """How an xml parameter's value is written and read: "string" (raw text, the value itself),
    "json" (one non-string type: JSON text, which the grammar enforces), or "raw" (no type or several:
    raw text, converted once whole)."""
    types = schema_types(schema)
    if types == {"string"}:
        return "string"
    return "json" if len(types) == 1 else "raw"


def parameter_schema(tool: Tool, key: str) -> Any:
    """The schema of one of a tool's parameters, a local "#/$defs/..." reference followed."""
    schema = (tool.parameters.get("properties") or {}).get(key)
    reference = schema.get("$ref") if isinstance(schema, dict) else None
    if not (isinstance(reference, str) and reference.startswith("#/")):
        return schema
    target: Any = tool.parameters
    for part in reference[2:].split("/"):
        target = target.get(part) if isinstance(target, dict) else None
    return target if isinstance(target, dict) else schema


def typed_value(raw: str, schema: Any) -> Any:
    """An xml parameter's raw text as the value its schema types: strings stay text; other types are
    read as JSON (and Python's True/False, which Qwen3-Coder's template writes), else kept as text."""
    types = schema_types(schema)
    if not types or types == {"string"}:
        return raw
    try:
        value = json_value(raw)
    except ValueError:
        value = raw.strip() == "True" if raw.strip() in ("True", "False") else raw
    kind = _json_type(value)
    if kind in types or (kind == "integer" and "number" in types):
        return value
    if kind == "number" and "integer" in types and value.is_integer():
        return int(value)
    return raw


def _refuse(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")  # Python's json reads NaN and Infinity; JSON has neither
