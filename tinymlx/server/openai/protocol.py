"""OpenAI's request bodies (with vLLM's extra sampling fields) and how they become SamplingParams.

Bodies are parsed strictly: a wrong type is a 400 naming the field, never a silent coercion. Fields
OpenAI defines that tinymlx does not serve (logit_bias, suffix, ...) are refused the same way rather
than ignored, so a client never gets an answer to a question it did not ask.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tinymlx.core.sampling_params import MAX_LOGPROBS, SamplingParams
from tinymlx.server.openai.chat import chat_turn
from tinymlx.server.sampling_fields import SamplingFields
from tinymlx.turns.api_error import APIError
from tinymlx.turns.turn import ChatTurn

__all__ = ["ChatCompletionRequest", "CompletionRequest"]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class _SamplingRequest(SamplingFields):
    """Fields both endpoints share. `priority` is vLLM's; `user` names the tenant for fair scheduling."""

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    priority: int = 0
    logit_bias: dict[str, float] | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def constraint(self) -> tuple[str | None, dict[str, Any]]:
        """(the field that asked, SamplingParams' constraint fields) from whichever form was used."""
        asked: list[tuple[str, dict[str, Any]]] = []
        if self.response_format not in (None, {"type": "text"}):
            asked.append(("response_format", _response_format(self.response_format)))
        if self.structured_outputs:
            outputs = dict(self.structured_outputs)
            names = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                     "json_object": "json_object"}
            unknown = set(outputs) - set(names)
            if unknown:
                raise APIError(400, f"structured_outputs: unsupported field(s) {sorted(unknown)}; "
                               f"use one of {sorted(names)}", "structured_outputs")
            asked.append(("structured_outputs", {names[k]: v for k, v in outputs.items() if v not in (None, False)}))
        for field, name in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):
            if getattr(self, field) is not None:
                asked.append((field, {name: getattr(self, field)}))
        if len(asked) > 1 or (asked and len(asked[0][1]) > 1):
            fields = [field for field, _ in asked]
            raise APIError(400, f"at most one structured-output constraint per request, got {fields}", fields[0])
        return asked[0] if asked else (None, {})

    def check_supported(self) -> None:
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", "logit_bias")
        if not 1 <= self.n <= 16:
            raise APIError(400, f"n must be between 1 and 16, got {self.n}", "n")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, choice: int) -> SamplingParams:
        """Choice `choice` of n: a seeded request gives each choice its own seed, so they differ."""
        values = {
            **self.sampling_values(), "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens,
            "seed": None if self.seed is None else self.seed + choice, "max_tokens": max_tokens, "logprobs": logprobs,
        }
        constraint_field, constraint = self.constraint()
        try:
            return SamplingParams(**{k: v for k, v in values.items() if v is not None}, **constraint)
        except ValueError as error:  # SamplingParams names the field first: "top_p must be in ..."
            field = str(error).split(" ", 1)[0]
            raise APIError(400, str(error), field if field in values else constraint_field) from None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: e.g. {"enable_thinking": false}
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # the template's, as is

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", "top_logprobs")

    def turn(self) -> ChatTurn:
        effort = {"reasoning_effort": self.reasoning_effort} if self.reasoning_effort is not None else {}
        return chat_turn(self.messages, self.tools, self.tool_choice, self.parallel_tool_calls,
                         {**effort, **(self.chat_template_kwargs or {})})

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported", "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}", "logprobs")
        if isinstance(self.prompt, list) and not self.prompt:
            raise APIError(400, "prompt must not be empty", "prompt")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or token ids (OpenAI accepts a batch of either)."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)

    @property
    def requested_max_tokens(self) -> int | None:
        return 16 if self.max_tokens is None else self.max_tokens  # OpenAI's default for completions

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


Endpoint = Literal["chat", "completion"]


def _response_format(response_format: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", ...}}."""
    kind = response_format.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "json_schema" not in spec:
            raise APIError(400, "response_format.json_schema must be an object with a 'schema'",
                           "response_format")
        return {"json_schema": spec.get("schema", spec.get("json_schema"))}
    raise APIError(400, f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                   "response_format")
