"""How EngineConfig's fields are offered to users. Each user field is declared once, with `option`: its
default, its command-line flag and its help. `LLM(**options)` takes exactly these fields and cli.py builds
the engine flags of `chat`, `serve` and `generate` from them, so the three cannot drift apart."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_GIB = 1 << 30
_FIELD_DEFAULT = object()  # a flag whose default is its field's


@dataclass(frozen=True)
class Flag:
    """A field's command-line flag, in argparse's terms (help is %-formatted: write 15%% for 15%).
    Without `parse` the field's type reads the text (int, float, str; a bool is a --x/--no-x pair)."""

    names: tuple[str, ...]  # the spellings, the main one first
    help: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None  # text -> the field's value; ValueError names what is wrong
    exclusive: str | None = None  # flags naming the same group exclude each other
    off: tuple[str, str] | None = None  # a flag, and its help, that leaves the field unset whatever a command's default
    cli_default: Any = _FIELD_DEFAULT  # when the command line's differs: None there means cli.py derives it


def option(default: Any, *names: str, **flag: Any) -> Any:
    """A user field: its default and its flag (`names`, then Flag's other fields)."""
    return dataclasses.field(default=default, metadata={"flag": Flag(names, **flag)})


def flag_of(field: dataclasses.Field) -> Flag | None:
    """The field's flag; None for a field the config derives, which no user sets."""
    return field.metadata.get("flag")


def flag_default(field: dataclasses.Field) -> Any:
    """The flag's default: the field's, unless the flag says otherwise."""
    default = flag_of(field).cli_default
    return field.default if default is _FIELD_DEFAULT else default


def positive_gib(text: str) -> float:
    """A positive, finite number of GiB (--disk-cache-gb)."""
    try:
        gib = float(text)
    except ValueError:
        gib = float("nan")
    if not 0 < gib < float("inf"):
        raise ValueError(f"must be a positive number of GiB, got {text}")
    return gib


def gib_to_bytes(text: str) -> int:
    """A positive number of GiB, in bytes (--kv-cache-gb sets kv_cache_bytes)."""
    return max(1, int(positive_gib(text) * _GIB))
