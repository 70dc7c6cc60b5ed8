"""StepCounters: the engine's running totals, observed after each step (for stats() and the tests)."""

from __future__ import annotations

from collections.abc import Callable

from tinymlx.core.batch import StepRecord
from tinymlx.core.sequence import Sequence


class StepCounters:
    def __init__(self, seq_of: Callable[[int], Sequence]):
        self._seq_of = seq_of
        self.num_steps = self.num_generated_tokens = self.num_computed_prompt_tokens = 0
        self.last_batch = (0, 0)  # (tokens, sequences) of the last step, 0 when it scheduled nothing

    def observe(self, step: StepRecord) -> None:
        batch = step.batch
        self.last_batch = (batch.num_batched_tokens, len(batch.chunks))
        if batch.is_empty:
            return
        self.num_steps += 1
        self.num_generated_tokens += sum(len(tokens) for tokens in step.kept.values())
        for chunk in batch.chunks:  # the part of each chunk that is prompt
            prompt_end = self._seq_of(chunk.seq_id).num_prompt_tokens
            self.num_computed_prompt_tokens += max(0, min(chunk.start_position + chunk.num_tokens, prompt_end)
                                                   - chunk.start_position)
