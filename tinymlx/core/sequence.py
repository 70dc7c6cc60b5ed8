"""Sequence: one request's tokens, status and counters (its KV blocks and state slots are the block
manager's, keyed by its id: kv/block_manager.py)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tinymlx.core.images import PromptImages
from tinymlx.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Mutable state of one request, owned by the scheduler.

    `token_ids` holds prompt + output. `num_computed_tokens` counts tokens whose K/V sit in the
    pool; a decoding sequence has exactly one uncomputed token, the one it sampled last.
    """

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    tenant: str = "default"
    images: PromptImages | None = None  # the prompt's images: spans of its tokens, and M-RoPE positions
    token_ids: list[int] = field(init=False)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # when it left the waiting queue the first time
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    def block_keys(self, start: int, end: int) -> tuple[int, ...]:
        """What the prefix cache keys tokens start .. end - 1 by: their ids, and for image tokens their
        image's digest and offset (core/images.py), so only the same image hits."""
        if self.images is None:
            return tuple(self.token_ids[start:end])
        return self.images.keys(self.token_ids, start, end)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_placeholder_tokens(self) -> int:
        """1 while a step runs ahead of its sampled token (Scheduler.commit_ahead): the last token id is a
        negative placeholder until the token is read; else 0."""
        return int(bool(self.token_ids) and self.token_ids[-1] < 0)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
