"""OpenAI's response bodies and stream chunks, built from RequestOutputs (plain dicts, JSON-ready)."""

from __future__ import annotations

from typing import Any

from tinymlx.outputs import RequestOutput
from tinymlx.sampler import TokenLogprobs


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

    def choice(self, index: int, output: RequestOutput, prefix: str = "") -> dict:
        """A finished choice; `prefix` is the echoed prompt of a completion."""
        logprobs = self._logprobs(output.logprobs, len(prefix)) if output.logprobs is not None else None
        if self.endpoint == "chat":
            return {"index": index, "message": {"role": "assistant", "content": output.text},
                    "logprobs": logprobs, "finish_reason": output.finish_reason}
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
