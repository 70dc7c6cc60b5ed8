"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names and meanings)."""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

MAX_LOGPROBS = 20
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class Constraint(NamedTuple):
    """What a constrained request's output must match; `spec` is a JSON schema (as JSON text), a
    regex, a JSON list of the choices, a Lark/GBNF grammar, or "" for any JSON object."""

    kind: str
    spec: str


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 -> greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0  # [0, 1]
    repetition_penalty: float = 1.0  # > 0; HF-style: applies to prompt + output tokens
    presence_penalty: float = 0.0  # [-2, 2], OpenAI-style, output tokens only
    frequency_penalty: float = 0.0  # [-2, 2], output tokens only
    seed: int | None = None  # [0, 2**64)
    max_tokens: int = 256  # >= 1
    stop: tuple[str, ...] = ()  # a str or any iterable of str; stored as a tuple
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N alternatives to return; 0 = only the sampled token's logprob
    skip_special_tokens: bool = True
    # Structured output, at most one (checked against the tokenizer when the request is added):
    json_schema: dict[str, Any] | str | None = None  # a JSON schema, as a dict or JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # exactly one of these strings
    grammar: str | None = None  # Lark (llguidance's dialect) or GBNF

    def __post_init__(self) -> None:
        # Frozen: normalised values go in through object.__setattr__, once, here.
        set_ = object.__setattr__
        set_(self, "temperature", _float("temperature", self.temperature, 0.0, math.inf, "[0, inf)"))
        set_(self, "top_p", _float("top_p", self.top_p, 0.0, 1.0, "(0, 1]", lo_open=True))
        set_(self, "min_p", _float("min_p", self.min_p, 0.0, 1.0, "[0, 1]"))
        rp = _float("repetition_penalty", self.repetition_penalty, 0.0, math.inf, "(0, inf)", lo_open=True)
        set_(self, "repetition_penalty", rp)
        for name in ("presence_penalty", "frequency_penalty"):
            set_(self, name, _float(name, getattr(self, name), -2.0, 2.0, "[-2, 2]"))
        set_(self, "top_k", _int("top_k", self.top_k, -1, "-1, 0 (disabled) or >= 1"))
        set_(self, "max_tokens", _int("max_tokens", self.max_tokens, 1, ">= 1"))
        if self.seed is not None:
            set_(self, "seed", _int("seed", self.seed, 0, "None or in [0, 2**64)", hi=2**64 - 1))
        if self.logprobs is not None:
            allowed = f"None or in [0, {MAX_LOGPROBS}]"
            set_(self, "logprobs", _int("logprobs", self.logprobs, 0, allowed, hi=MAX_LOGPROBS))
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        set_(self, "stop", _stop_strings(self.stop))
        set_(self, "stop_token_ids", _stop_token_ids(self.stop_token_ids))
        set_(self, "json_schema", _json_schema(self.json_schema))
        set_(self, "choice", _choices(self.choice))
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        given = [kind for kind in CONSTRAINT_KINDS if getattr(self, kind) not in (None, False)]
        if len(given) > 1:
            raise ValueError(f"at most one constraint per request, got {' and '.join(given)}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def constraint(self) -> Constraint | None:
        if self.json_schema is not None:
            return Constraint("json_schema", self.json_schema)
        if self.json_object:
            return Constraint("json_object", "")
        if self.regex is not None:
            return Constraint("regex", self.regex)
        if self.choice is not None:
            return Constraint("choice", json.dumps(list(self.choice)))
        if self.grammar is not None:
            return Constraint("grammar", self.grammar)
        return None


def _float(name: str, value: object, lo: float, hi: float, allowed: str, lo_open: bool = False) -> float:
    # bool is a number subclass; `temperature=True` is a bug, not a request for 1.0.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number in {allowed}, got {value!r}")
    value = float(value)
    if not (math.isfinite(value) and lo <= value <= hi) or (lo_open and value == lo):
        raise ValueError(f"{name} must be in {allowed}, got {value!r}")
    return value


def _int(name: str, value: object, lo: int, allowed: str, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int ({allowed}), got {value!r}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return value


def _stop_strings(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, Iterable):
        raise ValueError(f"stop must be a str or a sequence of str, got {stop!r}")
    items = tuple(stop)
    for s in items:
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop must contain only non-empty strings, got {s!r} in {list(items)!r}")
    return items


def _stop_token_ids(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, Iterable) or isinstance(ids, (str, bytes)):
        raise ValueError(f"stop_token_ids must be a sequence of int, got {ids!r}")
    items = tuple(ids)
    for t in items:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise ValueError(f"stop_token_ids must contain only ints >= 0, got {t!r} in {list(items)!r}")
    return tuple(int(t) for t in items)


def _json_schema(schema: object) -> str | None:
    """Stored as compact JSON text, so the params stay hashable and print the schema as sent."""
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"json_schema must be a JSON object (a dict or its JSON text), got {schema!r}")
    return json.dumps(schema, separators=(",", ":"))


def _choices(choice: object) -> tuple[str, ...] | None:
    if choice is None:
        return None
    if isinstance(choice, str) or not isinstance(choice, Iterable):
        raise ValueError(f"choice must be a sequence of strings, got {choice!r}")
    items = tuple(choice)
    if not items or not all(isinstance(c, str) and c for c in items):
        raise ValueError(f"choice must be a non-empty sequence of non-empty strings, got {list(items)!r}")
    return items
