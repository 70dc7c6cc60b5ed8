"""Iteration-level scheduler: a token budget per step, chunked prefill, recompute preemption.

Each step, in this order:
  1. every running sequence that is decoding gets its one token (growing its block table at a
     block boundary; when the pool is dry the policy's victim is preempted and requeued);
  2. with speculative decoding, decoding sequences get slots for draft tokens to verify, from
     the budget and the blocks free now (never by preempting anyone);
  3. running sequences still prefilling get their next chunk from what budget is left;
  4. waiting sequences are admitted, in policy order, while budget, seats and blocks allow.
Decodes go first, so a long prompt is spread over many steps and never stalls anyone's next token.
Every step's activations stay within the config's allowance (core/step_memory.py): a prefill chunk at a
long context is shortened until its estimate fits, and a decode or draft that would pass it waits a step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from tinymlx.core.batch import ScheduledBatch, ScheduledChunk
from tinymlx.core.config import EngineConfig
from tinymlx.core.sequence import Sequence, SequenceStatus
from tinymlx.core.step_memory import StepActivations, largest_chunk
from tinymlx.kv.coordinator import KVCoordinator
from tinymlx.sched.policy import make_policy


class RequestTooLargeError(ValueError):
    """The request can never be served by this engine, however long it waits."""


class Scheduler:
    def __init__(self, config: EngineConfig, kv_coordinator: KVCoordinator,
                 plan_drafts: Callable[[list[Sequence]], dict[int, int]] | None = None):
        """`plan_drafts` (speculative decoding): the decoding sequences of a step -> draft tokens wanted by each."""
        assert config.is_resolved
        self.config, self.kv_coordinator, self.plan_drafts = config, kv_coordinator, plan_drafts
        self.policy = make_policy(config.scheduling_policy)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a sequence Engine.validate checked (with check_fits, below): it is not checked again."""
        self.waiting.append(seq)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise RequestTooLargeError for a request that could never finish. A prompt that leaves no
        room is named alone: no max_tokens would help it."""
        total, limit = num_prompt_tokens + max_tokens, self.config.max_model_len
        if num_prompt_tokens >= limit:
            raise RequestTooLargeError(f"the prompt ({num_prompt_tokens} tokens) leaves no room in the maximum "
                                       f"context of {limit} tokens; shorten it")
        if total > limit:
            raise RequestTooLargeError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds the "
                f"maximum context of {limit} tokens; shorten the prompt or lower max_tokens"
            )
        chunk = self.config.max_num_batched_tokens
        too_large = self.kv_coordinator.too_large(num_prompt_tokens + 1, chunk)
        if too_large is not None:
            needed, there = too_large
            raise RequestTooLargeError(f"the prompt ({num_prompt_tokens} tokens) leaves no room in the KV pool: "
                                       f"with one new token it needs {needed} pages but the whole pool has "
                                       f"{there}; shorten it or raise num_pages")
        too_large = self.kv_coordinator.too_large(total, chunk)
        if too_large is not None:
            needed, there = too_large
            raise RequestTooLargeError(
                f"prompt + max_tokens needs {needed} KV pages but the whole pool has "
                f"{there}; raise num_pages or lower max_tokens"
            )

    def max_new_tokens(self, num_prompt_tokens: int) -> int:
        """The most tokens a prompt this long could ever generate here: what both the context and the
        pool leave (0 or less: none). The server clamps a client's max_tokens to it."""
        longest = self.kv_coordinator.max_num_tokens(self.config.max_num_batched_tokens)
        return int(min(self.config.max_model_len, longest)) - num_prompt_tokens

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[int] = []

        for seq in self._decodes_within_allowance([s for s in self.running if s.num_uncomputed_tokens == 1]):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            while not self.kv_coordinator.append_slot(seq):
                # Only a sequence not yet given work this step may be preempted (seq itself included).
                scheduled = {c.seq_id for c in chunks}
                victim = self.policy.select_victim([s for s in self.running if s.seq_id not in scheduled])
                self._preempt(victim)
                preempted.append(victim.seq_id)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                chunks.append(self._schedule_chunk(seq, 1))
                budget -= 1

        if self.plan_drafts is not None and chunks:  # after every decode has its slot: drafts take what is left
            by_id = {s.seq_id: s for s in self.running}
            wanted = self.plan_drafts([by_id[c.seq_id] for c in chunks])
            # Each chunk's drafts are sized beside the others: those before it with their drafts, those
            # after it without. Both estimates are built once (the suffixes backwards), not per chunk.
            after = [self._activations([])]
            for chunk in reversed(chunks[1:]):
                after.append(self._activations([chunk], after[-1]))
            before = self._activations([])
            for i, chunk in enumerate(chunks):
                seq = by_id[chunk.seq_id]
                beside = None if before is None else before.merged(after[-1 - i])
                within = self._room(beside, seq.num_computed_tokens, 1 + wanted.get(seq.seq_id, 0)) - 1
                num_drafts = self._num_drafts(seq, min(wanted.get(seq.seq_id, 0), within), budget)
                chunks[i] = chunk._replace(num_draft_tokens=num_drafts, block_tables=self.kv_coordinator.page_tables(seq),
                                           state=self.kv_coordinator.with_snapshots(seq, chunk.state, num_drafts))
                before = self._activations([chunks[i]], before)
                budget -= num_drafts

        step = self._activations(chunks)  # the step's estimate so far: each chunk below adds to it
        for seq in [s for s in self.running if s.num_uncomputed_tokens > 1]:
            if budget == 0:
                break
            room = self._room(step, seq.num_computed_tokens, budget)
            num = self.kv_coordinator.chunk_end(seq, room) - seq.num_computed_tokens
            if num == 0 or not self.kv_coordinator.grow(seq, seq.num_computed_tokens + num):
                continue  # no block end within the budget, or a sliding group's pool is short this step
            chunks.append(self._schedule_chunk(seq, num))
            step = self._activations(chunks[-1:], step)
            budget -= num

        # Under memory pressure admit nothing new: it would only be preempted again.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.policy.select(self.waiting)
            if not self.kv_coordinator.can_begin(seq, budget):
                break  # its first chunk cannot end within the budget (a recurrent one ends at a block end): next step
            num_cached = self.kv_coordinator.allocate(seq, first_chunk_tokens=budget)
            if num_cached is None:
                break
            seq.num_computed_tokens = num_cached
            room = self._room(step, num_cached, budget)
            num = self.kv_coordinator.chunk_end(seq, room) - seq.num_computed_tokens
            if num == 0:  # an image it resumes inside, or its activations, do not fit what the step leaves: next step
                self.kv_coordinator.free(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.running.append(seq)
            chunks.append(self._schedule_chunk(seq, num))
            step = self._activations(chunks[-1:], step)
            budget -= num

        return ScheduledBatch(chunks, self.config.max_num_batched_tokens - budget, preempted, self.kv_coordinator.extent())

    def _activations(self, chunks: list[ScheduledChunk], beside: StepActivations | None = None
                     ) -> StepActivations | None:
        """The activations' estimate of `chunks` (their draft slots included) added to `beside` (None: to
        nothing); None where the model gives no shape to estimate from."""
        if self.config.step_shape is None:
            return None
        pieces = [(c.num_tokens + c.num_draft_tokens, c.start_position + c.num_tokens + c.num_draft_tokens)
                  for c in chunks]
        return (StepActivations(self.config.step_shape) if beside is None else beside).plus(pieces)

    def _room(self, beside: StepActivations | None, start: int, wanted: int) -> int:
        """The most tokens (up to `wanted`) a chunk from `start` may add to the step's estimate `beside`
        within the activations' allowance (which holds the smallest step, a block of tokens at the longest
        context: config.py); `wanted` where there is no estimate."""
        if beside is None:
            return wanted
        return largest_chunk(beside, start, wanted, self.config.activation_bytes)

    def _decodes_within_allowance(self, decoding: list[Sequence]) -> list[Sequence]:
        """The decodes this step may take, in order: all of them, unless their activations together (long
        contexts, many sequences) pass the allowance; then those up to where it is reached, the rest wait."""
        if self.config.step_shape is None:
            return decoding
        estimate = StepActivations(self.config.step_shape)
        for i, seq in enumerate(decoding):
            estimate = estimate.plus([(1, seq.num_tokens)])
            if i and estimate.bytes() > self.config.activation_bytes:
                return decoding[:i]
        return decoding

    def _num_drafts(self, seq: Sequence, wanted: int, budget: int) -> int:
        """Draft slots for `seq`: what the plan wants, within the budget, the request's max_tokens
        and context (the bonus token needs room too), and the blocks free now."""
        room = min(budget, seq.params.max_tokens - seq.num_output_tokens - 1,
                   self.config.max_model_len - seq.num_tokens - 1)
        wanted = min(wanted, room)
        return self.kv_coordinator.reserve_slots(seq, wanted) if wanted > 0 else 0

    def _schedule_chunk(self, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        end = start + num_tokens
        # A block that ends at a pending token is published when its token is read (commit).
        self.kv_coordinator.cache_full_blocks(seq, min(end, len(seq.token_ids)))
        self.policy.record_service(seq, num_tokens)
        seq.first_scheduled_time = seq.first_scheduled_time or time.monotonic()
        pending_row = seq.pending_row if end > len(seq.token_ids) else None
        return ScheduledChunk(seq.seq_id, seq.token_ids[start:end], start, self.kv_coordinator.page_tables(seq),
                              end == seq.num_tokens, state=self.kv_coordinator.state_access(seq, start, end),
                              images=seq.images, pending_row=pending_row)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the K/V, keep the tokens, requeue."""
        assert not seq.num_pending_tokens, "no step runs ahead of one that preempts"
        self.running.remove(seq)
        self.kv_coordinator.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)

    def commit(self, batch: ScheduledBatch, sampled: dict[int, list[int]], finish_reasons: dict[int, str]) -> None:
        """Advance each scheduled sequence, append its new tokens, finish and free the done.

        A verified chunk [t, d1 .. dk] that kept tokens [d1 .. da, b] has K/V for t and d1 .. da:
        its computed count moves by a + 1, and blocks that only held rejected drafts are freed.
        A chunk committed ahead (`commit_ahead`) moved on then: its pending token is read in now.
        """
        by_id, now = {seq.seq_id: seq for seq in self.running}, time.monotonic()
        for chunk in batch.chunks:
            seq = by_id[chunk.seq_id]
            new_tokens = sampled.get(chunk.seq_id, [])
            if new_tokens:
                seq.first_token_time = seq.first_token_time or now
            if seq.num_pending_tokens:
                seq.token_ids.extend(new_tokens)
                seq.pending_row = None
                self.kv_coordinator.cache_full_blocks(seq, chunk.start_position + chunk.num_tokens)
                continue
            seq.num_computed_tokens += len(new_tokens) if chunk.num_draft_tokens else chunk.num_tokens
            seq.token_ids.extend(new_tokens)
            self.kv_coordinator.trim(seq)
            # A verified chunk that kept fewer positions than it ran rolls its state back to a snapshot.
            rolled_back = chunk.num_draft_tokens and len(new_tokens) < len(chunk.token_ids)
            self.kv_coordinator.commit_state(seq, len(new_tokens) if rolled_back else None)
        for seq_id, reason in finish_reasons.items():
            self.finish(by_id[seq_id], reason)

    def commit_ahead(self, batch: ScheduledBatch, rows: dict[int, int]) -> None:
        """Advance each chunk's sequence as `commit` does before its sampled token is known (an overlapped
        step: engine/run_ahead.py): the sequence holds one pending token, the step's draw at `rows[seq_id]`
        (a placeholder the next step's chunk names as its `pending_row`), until `commit` reads it in. Every
        chunk is one generated token's decode."""
        by_id = {seq.seq_id: seq for seq in self.running}
        for chunk in batch.chunks:
            seq = by_id[chunk.seq_id]
            assert chunk.num_tokens == chunk.num_logits == 1 and not seq.num_pending_tokens
            seq.num_computed_tokens += chunk.num_tokens
            seq.pending_row = rows[chunk.seq_id]
            self.kv_coordinator.trim(seq)
            self.kv_coordinator.commit_state(seq)

    def can_schedule_ahead(self) -> bool:
        """Whether the next schedule decides alike however the step in flight ends (a sequence that stops
        there still holds its seat, budget and blocks until its token is read): nothing waits or prefills,
        every decode fits the budget, and its next block is a never-cached free one, so no one is
        preempted and no cached block evicted because of it."""
        return (not self.waiting and all(seq.num_uncomputed_tokens == 1 for seq in self.running)
                and len(self.running) <= self.config.max_num_batched_tokens
                and len(self._decodes_within_allowance(self.running)) == len(self.running)
                and self.kv_coordinator.can_grow_without_eviction(self.running))

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.num_pending_tokens:  # aborted while a step runs ahead: back to where its last read token left it
            seq.pending_row = None
            seq.num_computed_tokens -= 1
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.kv_coordinator.free(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.finish_time = reason, time.monotonic()

    def check(self) -> None:
        assert not any(self.kv_coordinator.holds_blocks(s.seq_id) for s in self.waiting), "a waiting sequence holds blocks"
        assert all(s.status is SequenceStatus.RUNNING for s in self.running)
        assert not any(s.num_pending_tokens for s in self.waiting), "a waiting sequence has a token in flight"
        self.kv_coordinator.check(self.running)

