"""MTPProposer: drafts with the checkpoint's own multi-token-prediction head (models/mtp.py).

    after each step (observe)   the head runs over the step's computed tokens, shifted by one: at each
                                position p it reads the target's hidden state h_p and the token x_{p+1},
                                known now (the next prompt token, or what the step kept), and writes its K/V
                                at p. Where a chunk sampled, the head's logits at its last position give the
                                next step's first draft, and its hidden state stands in for the target's.
    propose (next schedule)     drafts 2 .. k chained from there: one forward per draft position, batched
                                over the sequences drafting that far.

The head's K/V live in a pool of its own that the target's full-attention block tables address
(`table_group`), as a draft model's do: prefix hits and preemption need nothing more. K/V it wrote at draft
positions are rewritten from real hidden states by the next step's pass; a block restored from the disk
tier carries none (its drafts are then weaker, never wrong: every draft is verified).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx

from tinymlx.core.batch import ScheduledBatch, ScheduledChunk, StepRecord
from tinymlx.core.sequence import Sequence, SequenceStatus
from tinymlx.models import HeadInput
from tinymlx.speculative.step_cost import StepCostCurve


class _FirstDraft(NamedTuple):
    start: int  # where the sequence's next chunk starts: the draft is for it only
    token: int
    hidden: mx.array  # [1, hidden] the head's state after it, to draft on from


class MTPProposer:
    def __init__(self, runner, target_runner, seq_of: Callable[[int], Sequence], cost: StepCostCurve,
                 table_group: int = 0):
        """`runner`: a ModelRunner over the MTPModel; `target_runner`: the target's, keeping its hidden states."""
        self.runner, self.target_runner, self._seq_of = runner, target_runner, seq_of
        self.cost = cost  # learns the chained forwards' time (the pass after each step is always paid)
        self.table_group = table_group
        self._first: dict[int, _FirstDraft] = {}

    def available(self, seq: Sequence, limit: int) -> int:
        first = self._first.get(seq.seq_id)
        return limit if first is not None and first.start == seq.num_computed_tokens else 0

    def committed(self, seq_id: int, num_computed_tokens: int) -> None:
        pass  # the next pass over the step rewrites what the head drafted past the kept tokens

    def forget(self, seq_id: int) -> None:
        self._first.pop(seq_id, None)

    def observe(self, step: StepRecord) -> None:
        """The head's pass over the step just committed (see the module's docstring)."""
        chunks, rows = [], []
        for chunk in step.batch.chunks:
            seq = self._seq_of(chunk.seq_id)
            num_kept = len(step.kept.get(chunk.seq_id, ())) if chunk.num_draft_tokens else len(chunk.token_ids)
            if seq.status is not SequenceStatus.RUNNING or not num_kept:
                continue
            start = chunk.start_position
            rows += [self.target_runner.last_row_of[chunk.seq_id, start + i] for i in range(num_kept)]
            chunks.append(ScheduledChunk(chunk.seq_id, seq.token_ids[start + 1:start + num_kept + 1], start,
                                         (chunk.block_tables[self.table_group],), chunk.needs_sample))
        if not chunks:
            return
        hidden = self.target_runner.last_hidden[mx.array(rows)]
        logits, out = self.runner.run_with_context(ScheduledBatch(chunks, len(rows), []), HeadInput(hidden))
        sampled = [c for c in chunks if c.needs_sample]
        for i, (chunk, token) in enumerate(zip(sampled, mx.argmax(logits, axis=-1).tolist() if sampled else [])):
            self._first[chunk.seq_id] = _FirstDraft(chunk.start_position + len(chunk.token_ids), token, out[i:i + 1])

    def propose(self, chunks: list[ScheduledChunk], seqs: dict[int, Sequence]) -> dict[int, list[int]]:
        drafts, states = {}, {}
        for chunk in chunks:
            first = self._first.get(chunk.seq_id)
            fresh = first is not None and first.start == chunk.start_position
            drafts[chunk.seq_id] = [first.token] if fresh else []
            if fresh:
                states[chunk.seq_id] = first.hidden
        depth = 1
        while True:  # draft depth + 1 reads the head's own state after draft `depth`, at the position before it
            step = [c for c in chunks if c.seq_id in states and len(drafts[c.seq_id]) < c.num_draft_tokens]
            if not step:
                return drafts
            batch = ScheduledBatch([ScheduledChunk(c.seq_id, drafts[c.seq_id][-1:], c.start_position + depth - 1,
                                                   (c.block_tables[self.table_group],), True) for c in step],
                                   len(step), [])
            started = time.perf_counter()
            logits, out = self.runner.run_with_context(
                batch, HeadInput(mx.concatenate([states[c.seq_id] for c in step]), depth))
            tokens = mx.argmax(logits, axis=-1).tolist()
            self.cost.observe(len(step), time.perf_counter() - started)
            for i, (chunk, token) in enumerate(zip(step, tokens)):
                drafts[chunk.seq_id].append(token)
                states[chunk.seq_id] = out[i:i + 1]
            depth += 1
