"""Speculative decoding: a proposer guesses a sequence's next tokens, one forward verifies them.

    scheduler:  a decoding sequence ... t gets t's slot and k draft slots (the blocks free now)
    proposer:   d1 d2 d3            n-gram lookup in the sequence itself, or the draft model run k times
    forward:    [t d1 d2 d3] beside every other chunk of the batch: logits at all four positions
    sampler:    s0 s1 s2 s3         each drawn exactly as a plain decode step would at that position
    accept:     keep s0 .. s_a, where s_i == d_(i+1) for every i < a: the agreeing drafts, plus one

The acceptance rule. Proposals here are deterministic (greedy), so the proposal distribution q puts
all its mass on d, and the standard speculative rule accepts d with probability p(d) and otherwise
samples from p without d. Drawing s ~ p with the uniforms a plain step would use, and accepting iff
s == d, is that rule: P(accept) = p(d), and a rejection leaves s ~ p given s != d. So every token kept
is the token non-speculative decoding would have produced at that position: lossless for greedy and
sampling alike, and a seeded request's output does not depend on whether, or how far, it speculated.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tinymlx.batch import ScheduledBatch, ScheduledChunk
from tinymlx.sequence import Sequence

# Extra rows cost little until the batch is this big (the device's flat region; on the CPU,
# PERF-NOTES' curve rises ~20-40 ms per row at M = 1-8 and ~3 ms per row at M = 8-16).
_DEFAULT_MAX_BATCH_ROWS = {"cpu": 16, "gpu": 64}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft"
    draft_model: str | None = None
    max_draft_tokens: int = 6
    ngram_max: int = 4  # longest suffix looked up
    ngram_min: int = 2  # shortest suffix that may propose
    max_batch_rows: int | None = None  # decode rows + drafts per step; None: the device's default

    @classmethod
    def parse(cls, spec: str) -> SpeculativeConfig:
        """"ngram", "ngram:max_draft=8,max_n=5,min_n=2,rows=16" or "draft:<model>[,max_draft=4]"."""
        method, _, rest = spec.partition(":")
        keys = {"max_draft": "max_draft_tokens", "max_n": "ngram_max", "min_n": "ngram_min", "rows": "max_batch_rows"}
        values: dict = {}
        if method == "draft":
            model, *options = rest.split(",")
            if not model:
                raise ValueError("speculative='draft:<model>' needs a model: a directory, .gguf, offline name or Hub id")
            values["draft_model"] = model
        elif method == "ngram":
            options = [o for o in rest.split(",") if o]
        else:
            raise ValueError(f"speculative must be 'ngram' or 'draft:<model>', got {spec!r}")
        for option in options:
            key, _, value = option.partition("=")
            if key not in keys or not value.isdigit() or int(value) < 1:
                raise ValueError(f"speculative option {option!r}: expected one of {', '.join(keys)} = a positive int")
            values[keys[key]] = int(value)
        config = cls(method, **values)
        if config.ngram_min > config.ngram_max:
            raise ValueError(f"speculative: min_n ({config.ngram_min}) is above max_n ({config.ngram_max})")
        return config


def accept(drafts: list[int], samples: list[int]) -> list[int]:
    """The tokens a verified chunk keeps: samples while each agrees with the draft it checked, then
    the first that does not (or the bonus past the last draft). `samples` has len(drafts) + 1."""
    kept = []
    for i, sample in enumerate(samples):
        kept.append(sample)
        if i == len(drafts) or sample != drafts[i]:
            break
    return kept


@dataclass
class _Acceptance:
    rate: float = 0.6  # exponential average of the share of drafts kept
    num_skipped: int = 0


@dataclass
class DraftLengths:
    """How many drafts a sequence gets: as many as its recent acceptance pays for, and no more than
    an equal share of the rows the batch can add cheaply (none once decodes alone fill them)."""

    max_draft_tokens: int
    max_batch_rows: int
    _acceptance: dict[int, _Acceptance] = field(default_factory=dict)

    def __call__(self, seq: Sequence, num_decoding: int) -> int:
        state = self._acceptance.setdefault(seq.seq_id, _Acceptance())
        share = (self.max_batch_rows - num_decoding) // max(num_decoding, 1)
        if share <= 0:
            return 0
        if state.rate < 0.15:  # drafts keep failing: stop, but look again now and then
            state.num_skipped += 1
            return 1 if state.num_skipped % 8 == 0 else 0
        # Draft while the chance that the whole run survives stays above one in four.
        length = self.max_draft_tokens if state.rate >= 0.95 else int(math.log(0.25) / math.log(state.rate))
        return max(1, min(length, self.max_draft_tokens, share))

    def record(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            state = self._acceptance.setdefault(seq_id, _Acceptance())
            state.rate = 0.7 * state.rate + 0.3 * num_accepted / num_drafts

    def forget(self, seq_id: int) -> None:
        self._acceptance.pop(seq_id, None)


class NgramProposer:
    """Prompt lookup: find the longest recent suffix of the sequence earlier in it, propose what
    followed. Free to run, and strong wherever the output copies its context (code edits)."""

    def __init__(self, ngram_max: int, ngram_min: int):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self._proposals: dict[int, list[int]] = {}  # looked up by `available`, handed out by `propose`

    def available(self, seq: Sequence, limit: int) -> int:
        proposal = self._lookup(np.asarray(seq.token_ids), limit)
        self._proposals[seq.seq_id] = proposal
        return len(proposal)

    def propose(self, chunks: list[ScheduledChunk], seqs: dict[int, Sequence]) -> dict[int, list[int]]:
        return {c.seq_id: self._proposals.pop(c.seq_id, [])[:c.num_draft_tokens] for c in chunks}

    def forget(self, seq_id: int) -> None:
        self._proposals.pop(seq_id, None)

    def _lookup(self, tokens: np.ndarray, limit: int) -> list[int]:
        length = len(tokens)
        for n in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
            windows = sliding_window_view(tokens[:length - 1], n)  # every earlier n-gram with a follower
            starts = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if len(starts):
                follow = starts[-1] + n  # the most recent occurrence
                return tokens[follow:follow + limit].tolist()
        return []


class DraftModelProposer:
    """A smaller model with the target's vocabulary proposes greedily, through the same paged runner.

    Its pool has the target's block ids, so a sequence's block table addresses both; it holds K/V for
    the tokens the draft has seen (`num_draft_computed_tokens`) and catches up on the rest (the
    prompt, verified tokens) in the first of its k forwards each step.
    """

    def __init__(self, runner):
        self.runner = runner  # a ModelRunner over the draft model, no tensor parallelism

    def available(self, seq: Sequence, limit: int) -> int:
        return limit

    def forget(self, seq_id: int) -> None:
        pass

    def propose(self, chunks: list[ScheduledChunk], seqs: dict[int, Sequence]) -> dict[int, list[int]]:
        drafts = {c.seq_id: [] for c in chunks}
        wanted = {c.seq_id: c.num_draft_tokens for c in chunks}
        tables = {c.seq_id: c.block_table for c in chunks}
        while True:
            active = [seq_id for seq_id, n in wanted.items() if len(drafts[seq_id]) < n]
            if not active:
                return drafts
            step = []
            for seq_id in active:
                seq, proposed = seqs[seq_id], drafts[seq_id]
                start = seq.num_draft_computed_tokens
                # First forward: every token the draft has not seen, up to the last; then its own drafts.
                tokens = proposed[-1:] if proposed else seq.token_ids[start:]
                step.append(ScheduledChunk(seq_id, tokens, start, tables[seq_id], True))
                seq.num_draft_computed_tokens = start + len(tokens)
            logits = self.runner.run(ScheduledBatch(step, sum(len(c.token_ids) for c in step), []))
            for seq_id, token in zip(active, mx.argmax(logits, axis=-1).tolist()):
                drafts[seq_id].append(token)


class Speculation:
    """What the engine holds: a proposer and the adaptive draft length, plus their counters."""

    def __init__(self, config: SpeculativeConfig, proposer: NgramProposer | DraftModelProposer, device: str):
        self.config, self.proposer = config, proposer
        rows = config.max_batch_rows or _DEFAULT_MAX_BATCH_ROWS.get(device, 16)
        self.lengths = DraftLengths(config.max_draft_tokens, rows)
        self.num_draft_tokens = self.num_accepted_tokens = self.num_verified_chunks = 0

    def draft_length(self, seq: Sequence, num_decoding: int) -> int:
        """The scheduler's hook: how many draft slots `seq` should get this step."""
        wanted = self.lengths(seq, num_decoding)
        return self.proposer.available(seq, wanted) if wanted else 0

    def fill(self, batch: ScheduledBatch, seqs: dict[int, Sequence]) -> ScheduledBatch:
        """Put the proposer's drafts into the chunks that got draft slots."""
        drafting = [c for c in batch.chunks if c.num_draft_tokens]
        drafts = self.proposer.propose(drafting, seqs)
        chunks = [c._replace(token_ids=c.token_ids + drafts[c.seq_id], num_draft_tokens=len(drafts[c.seq_id]))
                  if c.num_draft_tokens else c for c in batch.chunks]
        return batch._replace(chunks=chunks, num_batched_tokens=sum(len(c.token_ids) for c in chunks))

    def record(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        self.lengths.record(seq_id, num_drafts, num_accepted)
        if num_drafts:
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_accepted
            self.num_verified_chunks += 1

    def forget(self, seq_id: int) -> None:
        self.lengths.forget(seq_id)
        self.proposer.forget(seq_id)


def make_speculation(config: SpeculativeConfig, load_draft: Callable[[str], object], device: str) -> Speculation:
    """`load_draft(model)` returns a ModelRunner for the draft model (draft-model speculation only)."""
    if config.method == "ngram":
        return Speculation(config, NgramProposer(config.ngram_max, config.ngram_min), device)
    return Speculation(config, DraftModelProposer(load_draft(config.draft_model)), device)
