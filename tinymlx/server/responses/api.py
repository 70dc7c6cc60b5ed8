"""The OpenAI Responses API (POST /v1/responses, GET /v1/responses/{id}) as a WireFormat.

    the request body       -> ResponsesTurnRequest                                  parse(), here
      input items          -> Messages                                              responses_input.py
      instructions         -> a leading system message, not carried to the next response
      previous_response_id -> its stored conversation, before the input             responses_store.py
    TurnResult             -> the Response object                                   responses_body.py
    TurnEvents             -> the Response's event stream                           responses_stream.py
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import Field

from tinymlx.core.sampling_params import SamplingParams
from tinymlx.server.responses.body import ResponsesTurnRequest, finished_body, output_items
from tinymlx.server.responses.input import additional_tools, input_messages
from tinymlx.server.responses.store import ResponseStore
from tinymlx.server.responses.stream import ResponsesStream
from tinymlx.server.responses.tools import responses_tool_choice, responses_tools
from tinymlx.server.sampling_fields import SamplingFields
from tinymlx.server.strict_model import StrictModel, validated
from tinymlx.turns.api_error import APIError
from tinymlx.turns.turn import ChatTurn, Message, TurnRequest, TurnResult


# -- the request body ---------------------------------------------------------------------------
class _Format(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class _Text(StrictModel):
    format: _Format | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class _Reasoning(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # A summary is the reasoning itself: a local model's is short enough, and it is all there is.
    summary: Literal["auto", "concise", "detailed", "none"] | None = None


_INCLUDES = ("reasoning.encrypted_content", "message.output_text.logprobs", "web_search_call.action.sources",
             "web_search_call.results", "file_search_call.results", "code_interpreter_call.outputs",
             "computer_call_output.output.image_url", "message.input_image.image_url")


class ResponsesRequest(SamplingFields):  # with vLLM's sampling fields beyond OpenAI's
    model: str
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = None
    stream: bool | None = None
    store: bool | None = None  # None: true, as OpenAI
    previous_response_id: str | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    text: _Text | None = None
    reasoning: _Reasoning | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # not OpenAI's: vLLM's, passed to the template
    priority: int | None = None
    include: list[str] | None = None
    # prompt_cache_key, client_metadata, truncation: accepted, ignored. The prefix cache is keyed by the
    # tokens themselves, so no key can reach another prompt's blocks.
    # OpenAI's, not served: refused rather than ignored
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None


# -- the wire format ----------------------------------------------------------------------------
class OpenAIResponses:
    name = "responses"
    id_prefix = "resp"
    prompt_field = "input"

    def __init__(self, model_name: str, store_size: int = 256):
        self.model_name = model_name
        self._store = ResponseStore(store_size)

    def parse(self, body: dict[str, Any]) -> ResponsesTurnRequest:
        request = validated(ResponsesRequest, body)
        for name in ("conversation", "prompt"):
            if getattr(request, name) is not None:
                raise APIError(400, f"{name} is not supported; send the conversation as input", name)
        if request.background:
            raise APIError(400, "background responses are not supported", "background")
        if request.top_logprobs:
            raise APIError(400, "top_logprobs is not supported", "top_logprobs")
        earlier = self._earlier(request.previous_response_id) if request.previous_response_id else ()
        history = earlier + input_messages(request.input, earlier)
        if not history:
            raise APIError(400, "input must not be empty", "input")
        raw_tools = list(request.tools or [])
        raw_tools += [tool for tool in additional_tools(request.input) if tool not in raw_tools]
        offered = responses_tools(raw_tools)
        choice, choice_echo = responses_tool_choice(request.tool_choice, offered)
        include = _include(request.include or [])
        text = request.text or _Text()
        constraint = _constraint(text.format)
        sampling = request.sampling_values()
        _check_sampling(sampling, request.max_output_tokens, constraint)
        kwargs: dict[str, Any] = {}
        effort = request.reasoning.effort if request.reasoning else None
        summary = request.reasoning.summary if request.reasoning else None
        if effort is not None:  # unset: the template's own default (Qwen3 thinks, Qwen2.5 cannot)
            kwargs["enable_thinking"] = effort != "none"
            kwargs["reasoning_effort"] = effort  # gpt-oss's template reads it (low, medium, high)
        kwargs.update(request.chat_template_kwargs or {})
        instructions = (Message("system", request.instructions),) if request.instructions is not None else ()
        parallel = request.parallel_tool_calls is not False
        store = request.store is not False
        echo = {
            "instructions": request.instructions, "previous_response_id": request.previous_response_id,
            "tools": list(offered.echo),
            "tool_choice": choice_echo, "parallel_tool_calls": parallel, "temperature": request.temperature,
            "top_p": request.top_p, "max_output_tokens": request.max_output_tokens, "store": store,
            "text": {"format": (text.format.model_dump(by_alias=True, exclude_none=True) if text.format
                                else {"type": "text"}), "verbosity": text.verbosity},
            "reasoning": {"effort": effort, "summary": summary},
            "metadata": request.metadata or {}, "user": request.user, "truncation": "disabled", "background": False,
        }
        turn = ChatTurn(instructions + history, offered.tools, choice, parallel, kwargs)
        return ResponsesTurnRequest(request.model, turn, sampling, max_tokens=request.max_output_tokens,
                                    stream=bool(request.stream), user=request.user, priority=request.priority or 0,
                                    constraint=constraint, history=history, store=store, echo=echo,
                                    tool_origins=offered.origins, summarizes_reasoning=summary not in (None, "none"),
                                    seals_reasoning="reasoning.encrypted_content" in include)

    def error_body(self, error: APIError) -> dict[str, Any]:
        return error.body()  # the Responses API answers errors in chat/completions' shape

    def response(self, request_id: str, request: TurnRequest, result: TurnResult) -> dict[str, Any]:
        now = int(time.time())
        output = output_items(request_id, request, result)
        body = finished_body(self.model_name, request_id, request, result, output, now)
        self._store.keep(request_id, request, result, body)
        return body

    def stream(self, request_id: str, request: TurnRequest) -> ResponsesStream:
        return ResponsesStream(self.model_name, self._store, request_id, request)

    def get(self, response_id: str) -> dict[str, Any] | None:
        """The stored Response for GET /v1/responses/{id}; None: unknown, evicted or sent with store false."""
        return self._store.get(response_id)

    def delete(self, response_id: str) -> bool:
        return self._store.delete(response_id)

    def _earlier(self, response_id: str) -> tuple[Message, ...]:
        conversation = self._store.conversation(response_id)
        if conversation is None:
            raise APIError(404, f"Previous response with id '{response_id}' not found.", "previous_response_id",
                           "previous_response_not_found")
        return conversation


# -- include, text.format, sampling ------------------------------------------------------------
def _include(include: list[str]) -> list[str]:
    for i, name in enumerate(include):
        if name not in _INCLUDES:
            raise APIError(400, f"include[{i}]: unknown value {name!r}; known: {', '.join(_INCLUDES)}",
                           f"include[{i}]")
    return include


def _constraint(spec: _Format | None) -> dict[str, Any]:
    if spec is None or spec.type == "text":
        return {}
    if spec.type == "json_object":
        return {"json_object": True}
    if spec.name is None or spec.schema_ is None:
        raise APIError(400, "text.format of type json_schema needs a name and a schema", "text.format")
    return {"json_schema": spec.schema_}


def _check_sampling(sampling: dict[str, Any], max_tokens: int | None, constraint: dict[str, Any]) -> None:
    """A 400 now, naming this API's field, for what SamplingParams would refuse later."""
    try:
        SamplingParams(**sampling, **constraint, **({} if max_tokens is None else {"max_tokens": max_tokens}))
    except ValueError as error:  # SamplingParams names the field first: "top_p must be in ..."
        name = str(error).split(" ", 1)[0]
        param = "max_output_tokens" if name == "max_tokens" else name if name in sampling else "text.format"
        raise APIError(400, str(error), param) from None
