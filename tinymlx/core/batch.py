"""The plain data that crosses stages: ScheduledBatch (scheduler -> runner) and step results."""

from __future__ import annotations

from typing import NamedTuple

from tinymlx.core.images import PromptImages


class StateAccess(NamedTuple):
    """Where a chunk of a hybrid model's sequence finds its recurrent state and where it leaves it."""

    read_slot: int  # the state before the chunk: the sequence's live slot, a checkpoint it resumes from, or zero
    write_slot: int  # the sequence's live slot: the state after the chunk
    checkpoints: tuple[tuple[int, int], ...] = ()  # (tokens into the chunk, slot): states at block ends to keep


class ScheduledChunk(NamedTuple):
    """The tokens one sequence computes this step: a prefill chunk, a single decode token, or a
    decode token followed by draft tokens to verify (speculative decoding)."""

    seq_id: int
    token_ids: list[int]
    start_position: int  # position of token_ids[0]; its K/V land in slot_of(start_position)
    block_tables: tuple[tuple[int, ...], ...]  # one per KV group, indexed by position // block_size
    needs_sample: bool  # True when this chunk reaches the sequence's last token
    num_draft_tokens: int = 0  # the last n token_ids are drafts: every position of the chunk samples
    state: StateAccess | None = None  # models with recurrent layers only
    images: PromptImages | None = None  # the sequence's images (the runner takes the spans the chunk covers)
    # Its last token is not in token_ids: it is the step before's draw at this row, still on the device (a
    # step run ahead: engine/run_ahead.py). The runner takes it there.
    pending_row: int | None = None

    @property
    def num_tokens(self) -> int:
        """Positions the chunk computes: its token_ids, and the pending token after them if it takes one."""
        return len(self.token_ids) + (self.pending_row is not None)

    @property
    def num_logits(self) -> int:
        """Rows of logits this chunk needs: its last token's, plus one per draft."""
        return 1 + self.num_draft_tokens if self.needs_sample else 0

    def with_drafts(self, drafts: list[int]) -> ScheduledChunk:
        """This decode verifying `drafts` (at most its draft slots): the state snapshots past its end dropped."""
        assert self.pending_row is None, "drafts follow a token read on the host"
        token_ids = self.token_ids + drafts
        state = self.state
        if state is not None:
            state = state._replace(checkpoints=tuple((t, slot) for t, slot in state.checkpoints if t <= len(token_ids)))
        return self._replace(token_ids=token_ids, num_draft_tokens=len(drafts), state=state)

    def piece(self, start: int, end: int) -> ScheduledChunk:
        """Positions start..end-1 of the chunk (of its num_tokens) as a chunk of their own: the last piece keeps its
        sample and its pending token."""
        is_last = end == self.num_tokens
        return self._replace(token_ids=self.token_ids[start:end], start_position=self.start_position + start,
                             needs_sample=self.needs_sample and is_last,
                             pending_row=self.pending_row if is_last else None)

    @property
    def draft_token_ids(self) -> list[int]:
        return self.token_ids[len(self.token_ids) - self.num_draft_tokens:] if self.num_draft_tokens else []


class PoolExtent(NamedTuple):
    """How far the pools' arrays reach in a step (kv/block_pool.py): the KV arrays hold at most the pages below
    the state slots' region, each state pool's arrays its slots (the fixed ones and the region's). Together
    they stay within the pool's bytes."""

    kv_pages: int
    state_slots: tuple[int, ...] = ()


class ScheduledBatch(NamedTuple):
    """One step's work. Chunks are ordered single-token chunks first, then longer ones. `extent`: None for a
    draft model's batch, whose pool follows the target's pages."""

    chunks: list[ScheduledChunk]
    num_batched_tokens: int
    preempted_seq_ids: list[int]
    extent: PoolExtent | None = None

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def sampled_chunks(self) -> list[ScheduledChunk]:
        return [c for c in self.chunks if c.needs_sample]

    @property
    def num_draft_slots(self) -> int:
        return sum(c.num_draft_tokens for c in self.chunks)


class StepRecord(NamedTuple):
    """A finished step, for observers: its batch, the seconds its forward and sampling took, and the
    tokens each sequence kept (empty for a step that scheduled nothing or sampled nothing)."""

    batch: ScheduledBatch
    seconds: float
    kept: dict[int, list[int]]
