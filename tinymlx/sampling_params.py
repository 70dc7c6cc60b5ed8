"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names and meanings)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable
from dataclasses import dataclass

MAX_LOGPROBS = 20


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

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


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
