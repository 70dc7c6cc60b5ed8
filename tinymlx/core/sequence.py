"""Sequence: one request's tokens, status and counters (its KV blocks and state slots are the block
manager's, keyed by its id: kv/coordinator.py). The request itself is immutable (core/request.py)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tinymlx.core.images import PromptImages
from tinymlx.core.request import ValidRequest
from tinymlx.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """The scheduler's state of one request (`request`, which never changes), owned by the scheduler.

    `token_ids` holds prompt + output: real token ids only. `num_computed_tokens` counts tokens whose
    K/V sit in the pool; a decoding sequence has exactly one uncomputed token, the one it sampled last.
    `pending_row`: while a step runs ahead (engine/run_ahead.py), the row of its draws that holds this
    sequence's next token, sampled on the device and not yet read: it counts in `num_tokens`
    (`num_pending_tokens`) but is not in `token_ids` until read.
    """

    seq_id: int
    request: ValidRequest
    arrival_time: float = field(default_factory=time.monotonic)  # when the engine queued it
    token_ids: list[int] = field(init=False)
    pending_row: int | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # when it left the waiting queue the first time
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.request.token_ids)

    # -- the request's fields, read-only --------------------------------------------------------
    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def images(self) -> PromptImages | None:
        """The prompt's images: spans of its tokens, and M-RoPE positions."""
        return self.request.images

    @property
    def priority(self) -> int:
        return self.request.priority

    @property
    def tenant(self) -> str:
        return self.request.tenant

    # -- state ------------------------------------------------------------------------------------
    def block_keys(self, start: int, end: int) -> tuple[int, ...]:
        """What the prefix cache keys tokens start .. end - 1 by: their ids, and for image tokens their
        image's digest and offset (core/images.py), so only the same image hits. Known tokens only."""
        assert end <= len(self.token_ids), "a block key of a token not yet read"
        if self.images is None:
            return tuple(self.token_ids[start:end])
        return self.images.keys(self.token_ids, start, end)

    @property
    def num_pending_tokens(self) -> int:
        """1 while a token sampled on the device is not yet read (`pending_row`), else 0."""
        return int(self.pending_row is not None)

    @property
    def num_tokens(self) -> int:
        """Prompt + output, a pending token included."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The output tokens read so far (a pending one is not)."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        """Output tokens, a pending one included (as `num_tokens`)."""
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
