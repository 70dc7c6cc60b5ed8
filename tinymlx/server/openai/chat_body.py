"""OpenAI's response bodies and stream chunks, built from RequestOutputs (plain dicts, JSON-ready)."""

from __future__ import annotations

from typing import Any

from tinymlx.core.outputs import RequestOutput, TokenLogprobs
from tinymlx.turns.tool_calls import OutputParser
from tinymlx.turns.turn import ReasoningDelta, TextDelta, ToolArgumentsDelta, ToolCallStart, TurnEvent


class ResponseBuilder:
    """The shapes of one request's answer: `endpoint` is "chat" or "completion"."""

    def __init__(self, endpoint: str, request_id: str, model: str, created: int, tokenizer: Any):
        self.endpoint, self.request_id, self.model, self.created = endpoint, request_id, model, created
        self._tokenizer = tokenizer
        self._object = "chat.completion" if endpoint == "chat" else "text_completion"

    # -- whole responses ------------------------------------------------------------------------
    def response(self, choices: list[dict], usage: dict) -> dict:
        return {"id": self.request_id, "object": self._object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage}

    def choice(self, index: int, output: RequestOutput, prefix: str = "", parser: OutputParser | None = None) -> dict:
        """A finished choice; `prefix` is the echoed prompt of a completion, `parser` a chat reply's
        text, reasoning and tool calls, already fed the whole reply."""
        logprobs = self._logprobs(output.logprobs, len(prefix)) if output.logprobs is not None else None
        if self.endpoint == "chat":
            message = {"role": "assistant", "content": parser.text if parser.text or not parser.tool_calls else None}
            if parser.reasoning is not None:
                message["reasoning_content"] = parser.reasoning
            if parser.tool_calls:
                message["tool_calls"] = [{"id": call.id, "type": "function",
                                          "function": {"name": call.name, "arguments": call.arguments}}
                                         for call in parser.tool_calls]
            return {"index": index, "message": message, "logprobs": logprobs,
                    "finish_reason": finish_reason_of(output, parser)}
        return {"index": index, "text": prefix + output.text, "logprobs": logprobs,
                "finish_reason": output.finish_reason}

    # -- stream chunks --------------------------------------------------------------------------
    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        body = {"id": self.request_id, "object": f"{self._object}.chunk" if self.endpoint == "chat" else self._object,
                "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def role_delta(self, index: int) -> dict:
        """A chat stream opens each choice with the assistant role (OpenAI does)."""
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def delta(self, index: int, text: str, new_logprobs: list[TokenLogprobs] | None, finish_reason: str | None,
              text_offset: int = 0) -> dict:
        logprobs = self._logprobs(new_logprobs, text_offset) if new_logprobs is not None else None
        if self.endpoint == "chat":
            delta = {"content": text} if text or finish_reason is None else {}
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def chat_delta(self, index: int, events: list[TurnEvent], new_logprobs: list[TokenLogprobs] | None,
                   finish_reason: str | None) -> dict:
        """One chunk's delta from a chat reply's parsed events, merged in order: OpenAI's
        content, reasoning_content and tool_calls (id and name first, then argument pieces)."""
        delta: dict = {}
        calls: dict[int, dict] = {}
        for event in events:
            if isinstance(event, TextDelta):
                delta["content"] = delta.get("content", "") + event.text
            elif isinstance(event, ReasoningDelta):
                delta["reasoning_content"] = delta.get("reasoning_content", "") + event.text
            elif isinstance(event, ToolCallStart):
                calls[event.index] = {"index": event.index, "id": event.id, "type": "function",
                                      "function": {"name": event.name, "arguments": ""}}
            elif isinstance(event, ToolArgumentsDelta):
                call = calls.setdefault(event.index, {"index": event.index, "function": {"arguments": ""}})
                call["function"]["arguments"] += event.text
        if calls:
            delta["tool_calls"] = list(calls.values())
        logprobs = self._logprobs(new_logprobs, 0) if new_logprobs is not None else None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    # -- logprobs -------------------------------------------------------------------------------
    def _token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, entries: list[TokenLogprobs], text_offset: int) -> dict:
        if self.endpoint == "chat":
            def item(token_id: int, logprob: float) -> dict:
                token = self._token(token_id)
                return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

            return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                                for e in entries]}
        tokens = [self._token(e.token_id) for e in entries]
        offsets, offset = [], text_offset
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._token(t): lp for t, lp in e.top} or None for e in entries],
                "text_offset": offsets}


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def finish_reason_of(output: RequestOutput, parser: OutputParser | None) -> str:
    """OpenAI's "tool_calls" for a reply that ended after calling tools, else the engine's reason."""
    if parser is not None and parser.tool_calls and output.finish_reason == "stop":
        return "tool_calls"
    return output.finish_reason
