"""Overlapped steps: a step of decodes is committed ahead and left computing, and the next step is scheduled
and launched before its tokens are read (mlx-lm's generate loop does it with `mx.async_eval`; vLLM calls it
async scheduling). The host's commit and emit of step N then run while the device computes step N + 1:

    host    schedule N+1 | build N+1 | read N, commit, emit N | schedule N+2 | ...
    device  ... N ...............| N+1 .......................................| N+2

Step N's sequences move on with a pending token, a placeholder for their row of N's draws that is counted
but never written into their token ids (Scheduler.commit_ahead); step N+1's chunk names that row
(`ScheduledChunk.pending_row`), its forward takes the draw from the device (ModelRunner.start), and
Scheduler.commit reads the token in. A request that stopped at step N's token had a step N+1 row computed for
nothing: it is dropped.

Outputs are the synchronous step's. So a step is committed ahead only when it holds decodes alone, for
requests that need no token on the host to sample (penalties count them, a grammar's mask follows them),
and the next is scheduled before they are read only when that schedule cannot depend on them: nothing waits
or prefills, no decode could be preempted, cut by the budget or evict a cached block for want of the
blocks a stopped request would have freed, and none ends there by length (then it is read first: no step
runs for nothing). Tensor-parallel ranks take a step's tokens as host arrays, recurrent states publish
checkpoints at commit, and speculation and the disk tier read tokens or K/V around the forward (engine/
stages.py): engines with them run every step synchronously.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx

from tinymlx.core.batch import ScheduledBatch
from tinymlx.core.sequence import Sequence
from tinymlx.sample.sampler import DeviceSample
from tinymlx.sched.scheduler import Scheduler


class Launched(NamedTuple):
    """A step on its way: its batch, its draws on the device (None: nothing samples), when it started."""

    batch: ScheduledBatch
    sample: DeviceSample | None
    started: float


class RunAhead:
    """The step committed ahead, whose tokens are still on the device, and when the next may go before them.
    `is_enabled` False runs every step to its end (the synchronous step)."""

    def __init__(self, scheduler: Scheduler, max_model_len: int, seq_of: Callable[[int], Sequence | None],
                 is_possible: bool):
        """`seq_of`: a request's sequence, None once it ended."""
        self.scheduler, self.max_model_len, self._seq_of = scheduler, max_model_len, seq_of
        self.is_possible, self.is_enabled = is_possible, True
        self.in_flight: Launched | None = None

    @property
    def is_on(self) -> bool:
        return self.is_enabled and self.is_possible

    @property
    def pending(self) -> mx.array | None:
        """The draws that pending tokens are (a chunk's `pending_row` indexes them): the step in flight's."""
        return self.in_flight.sample.token_ids if self.in_flight is not None else None

    def take(self) -> Launched | None:
        launched, self.in_flight = self.in_flight, None
        return launched

    def can_schedule_ahead(self) -> bool:
        """Whether the next schedule may go before the step in flight's tokens are read."""
        return self.is_on and self.scheduler.can_schedule_ahead() and all(
            _samples_on_device(seq) and seq.num_output_tokens < seq.params.max_tokens
            and seq.num_tokens < self.max_model_len for seq in self.scheduler.running)

    def hold(self, launched: Launched) -> bool:
        """Commit `launched` ahead if it may be: each sequence still here moves on with a pending token, a
        placeholder for its row of the draws. False (nothing done) when it may not."""
        rows = {c.seq_id: row for row, c in enumerate(launched.batch.sampled_chunks)}
        live = [(c, seq) for c in launched.batch.chunks if (seq := self._seq_of(c.seq_id)) is not None]
        if not (self.is_on and launched.sample is not None and live and all(
                c.num_tokens == c.num_logits == 1 and c.start_position >= seq.num_prompt_tokens
                and _samples_on_device(seq) for c, seq in live)):
            return False
        chunks = [c for c, _ in live]
        self.scheduler.commit_ahead(launched.batch._replace(chunks=chunks, num_batched_tokens=len(chunks)),
                                    rows)
        self.in_flight = launched
        return True


def _samples_on_device(seq: Sequence) -> bool:
    params = seq.params
    return (params.constraint is None and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0)
