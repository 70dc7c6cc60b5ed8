"""The plain data that crosses stages: ScheduledBatch (scheduler -> runner) and step results."""

from __future__ import annotations

from typing import NamedTuple


class ScheduledChunk(NamedTuple):
    """The tokens one sequence computes this step: a prefill chunk or a single decode token."""

    seq_id: int
    token_ids: list[int]
    start_position: int  # position of token_ids[0]; its K/V land in slot_of(start_position)
    block_table: list[int]
    needs_sample: bool  # True when this chunk reaches the sequence's last token


class ScheduledBatch(NamedTuple):
    """One step's work. Chunks are ordered single-token chunks first, then longer ones."""

    chunks: list[ScheduledChunk]
    num_batched_tokens: int
    preempted_seq_ids: list[int]

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def sampled_chunks(self) -> list[ScheduledChunk]:
        return [c for c in self.chunks if c.needs_sample]
