"""ValidRequest: a request an engine has checked once, at the edge, and can serve."""

from __future__ import annotations

from dataclasses import dataclass

from tinymlx.core.images import PromptImages
from tinymlx.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class ValidRequest:
    """A prompt's token ids and its SamplingParams, as `Engine.validate` returns them: the prompt and
    max_tokens fit the context and the KV pool, and the constraint compiles. Faces that must answer
    before queueing (the server's 400s, LLM.generate's all or none, AsyncEngine's errors in the caller)
    hold one and pass it on as `checked` with its token ids and params; `Engine.add_request` then queues
    them without checking them again. `images`: the prompt's images, their placeholder tokens already
    expanded in `token_ids` (None for a text prompt).

    `request_id`, `priority` and `tenant` are the caller's too: `Engine.add_request` sets them when it
    queues the request (the id "" until then; a caller that gives none gets "req-<seq id>"). The queued
    request is what its `Sequence` refers to, unchanged for the request's life."""

    token_ids: list[int]
    params: SamplingParams
    images: PromptImages | None = None
    request_id: str = ""
    priority: int = 0  # lower is served first under the priority policy (sched/policy.py)
    tenant: str = "default"  # whose service the fair policy counts
