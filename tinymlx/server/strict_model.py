"""The pydantic base the Responses and Messages bodies are read with (strict types, unknown fields
ignored), and validated(): the first error as a 400 naming the field: "input[2].call_id"."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from tinymlx.turns.api_error import APIError

_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


def validated(model: type[BaseModel], data: Any, where: str = "", shown: Callable[[Any], str] = repr) -> Any:
    """model.model_validate, a ValidationError made a 400; `shown` writes the input it got."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = where
        for part in first["loc"]:
            if isinstance(part, int):
                param += f"[{part}]"
            elif part not in _UNION_TAGS and "[" not in part:  # pydantic names a union's member in loc
                param += f".{part}" if param else part
        got = "" if first["type"] == "missing" else f", got {shown(first['input'])}"
        raise APIError(400, f"{param}: {first['msg']}{got}", param or None) from None


def short_repr(value: Any) -> str:
    """repr cut to 80 characters: an input that may be a whole content block."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
