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

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tinymlx.batch import ScheduledBatch, ScheduledChunk
from tinymlx.sequence import Sequence


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft"
    draft_model: str | None = None
    max_draft_tokens: int = 6
    ngram_max: int = 4  # longest suffix looked up
    ngram_min: int = 2  # shortest suffix that may propose
    adaptive: bool = True  # False: every decoding sequence drafts max_draft_tokens, whatever it costs

    @classmethod
    def parse(cls, spec: str) -> SpeculativeConfig:
        """"ngram", "ngram:max_draft=8,max_n=5,min_n=2,adaptive=0" or "draft:<model>[,max_draft=4]"."""
        method, _, rest = spec.partition(":")
        keys = {"max_draft": "max_draft_tokens", "max_n": "ngram_max", "min_n": "ngram_min", "adaptive": "adaptive"}
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
            if key == "adaptive" and value in ("0", "1"):
                values["adaptive"] = value == "1"
            elif key in keys and key != "adaptive" and value.isdigit() and int(value) >= 1:
                values[keys[key]] = int(value)
            else:
                raise ValueError(f"speculative option {option!r}: expected max_draft, max_n or min_n = a positive "
                                 "int, or adaptive = 0 or 1")
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


def cpu_row_cost(rows: int) -> float:
    """A step's time relative to one row, on the CPU: PERF-NOTES' measure of every linear layer of
    the 0.5B model in float32 with OpenBLAS. Rows are dear up to 8, then nearly free up to 16."""
    measured = {1: 1.0, 2: 1.33, 3: 1.59, 4: 1.89, 5: 2.03, 6: 2.33, 8: 2.83, 12: 2.89, 16: 3.30}
    if rows >= 16:
        return measured[16] + 0.06 * (rows - 16)
    below = max(m for m in measured if m <= rows)
    above = min(m for m in measured if m >= rows)
    if below == above:
        return measured[rows]
    return measured[below] + (measured[above] - measured[below]) * (rows - below) / (above - below)


def gpu_row_cost(rows: int) -> float:
    """On a GPU a step reads the weights once whatever the rows, up to a few dozen."""
    return 1.0 + 0.01 * (rows - 1) + 0.03 * max(0, rows - 32)


@dataclass
class DraftPlanner:
    """How many drafts each decoding sequence gets this step: the plan that maximises expected
    tokens per unit of step time.

    A sequence whose drafts have been kept at rate a yields 1 + a + a^2 + .. + a^k tokens from k
    drafts. Drafts go one at a time to whichever sequence's next draft is most likely kept, and the
    plan is cut where tokens / row_cost(rows) peaked: on the CPU that gives a single stream several
    drafts and a batch of 16 almost none; unpredictable text (low a) gets none either way. The rate
    of a sequence not drafting drifts back towards the prior, so it gets tried again later.
    """

    max_draft_tokens: int
    row_cost: Callable[[int], float]
    draft_cost: float = 0.0  # a draft model's step, relative to the target's (0: n-gram lookup is free)
    prior: float = 0.6
    _rates: dict[int, float] = field(default_factory=dict)

    def plan(self, seqs: list[Sequence], available: dict[int, int]) -> dict[int, int]:
        rates = {s.seq_id: self._rates.setdefault(s.seq_id, self.prior) for s in seqs}
        drafts = dict.fromkeys(rates, 0)
        tokens, rows = float(len(seqs)), len(seqs)
        best, best_drafts = tokens / self.row_cost(rows), dict(drafts)
        while True:
            open_ = [i for i in drafts if drafts[i] < min(available.get(i, 0), self.max_draft_tokens)]
            if not open_:
                break
            i = max(open_, key=lambda j: rates[j] ** (drafts[j] + 1))
            drafts[i] += 1
            tokens += rates[i] ** drafts[i]
            rows += 1
            value = tokens / (self.row_cost(rows) + self.draft_cost * max(drafts.values()))
            if value > best:
                best, best_drafts = value, dict(drafts)
        for seq_id, n in best_drafts.items():
            if not n:  # not drafting: drift back towards the prior, to be tried again
                self._rates[seq_id] += 0.05 * (self.prior - self._rates[seq_id])
        return best_drafts

    def record(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            rate = self._rates.get(seq_id, self.prior)
            self._rates[seq_id] = 0.6 * rate + 0.4 * num_accepted / num_drafts

    def forget(self, seq_id: int) -> None:
        self._rates.pop(seq_id, None)


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

    Its pool has the target's full-attention block ids (`table_group`: that KV group of the target), so
    a sequence's block table there addresses both; it holds K/V for
    the tokens the draft has seen (`num_draft_computed_tokens`) and catches up on the rest (the
    prompt, verified tokens) in the first of its k forwards each step.
    """

    def __init__(self, runner, table_group: int = 0):
        self.runner = runner  # a ModelRunner over the draft model, no tensor parallelism
        self.table_group = table_group

    def available(self, seq: Sequence, limit: int) -> int:
        return limit

    def forget(self, seq_id: int) -> None:
        pass

    def propose(self, chunks: list[ScheduledChunk], seqs: dict[int, Sequence]) -> dict[int, list[int]]:
        drafts = {c.seq_id: [] for c in chunks}
        wanted = {c.seq_id: c.num_draft_tokens for c in chunks}
        tables = {c.seq_id: (c.block_tables[self.table_group],) for c in chunks}
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
    """What the engine holds: a proposer and the draft planner, plus their counters."""

    def __init__(self, config: SpeculativeConfig, proposer: NgramProposer | DraftModelProposer, device: str,
                 draft_cost: float = 0.0):
        self.config, self.proposer = config, proposer
        row_cost = cpu_row_cost if device == "cpu" else gpu_row_cost
        self.planner = DraftPlanner(config.max_draft_tokens, row_cost, draft_cost)
        self.num_draft_tokens = self.num_accepted_tokens = self.num_verified_chunks = 0

    def plan_drafts(self, seqs: list[Sequence]) -> dict[int, int]:
        """The scheduler's hook: draft slots wanted by each decoding sequence this step."""
        available = {s.seq_id: self.proposer.available(s, self.config.max_draft_tokens) for s in seqs}
        return self.planner.plan(seqs, available) if self.config.adaptive else available

    def fill(self, batch: ScheduledBatch, seqs: dict[int, Sequence]) -> ScheduledBatch:
        """Put the proposer's drafts into the chunks that got draft slots."""
        drafting = [c for c in batch.chunks if c.num_draft_tokens]
        drafts = self.proposer.propose(drafting, seqs)
        chunks = [c._replace(token_ids=c.token_ids + drafts[c.seq_id], num_draft_tokens=len(drafts[c.seq_id]))
                  if c.num_draft_tokens else c for c in batch.chunks]
        return batch._replace(chunks=chunks, num_batched_tokens=sum(len(c.token_ids) for c in chunks))

    def record(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        self.planner.record(seq_id, num_drafts, num_accepted)
        if num_drafts:
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_accepted
            self.num_verified_chunks += 1

    def forget(self, seq_id: int) -> None:
        self.planner.forget(seq_id)
        self.proposer.forget(seq_id)


def make_speculation(config: SpeculativeConfig, device: str, draft_runner=None, draft_cost: float = 0.0,
                     table_group: int = 0) -> Speculation:
    """`draft_runner`: a ModelRunner over the draft model (draft-model speculation), whose step costs
    `draft_cost` of the target's and whose pool shares the block ids of the target's KV group `table_group`."""
    if config.method == "ngram":
        return Speculation(config, NgramProposer(config.ngram_max, config.ngram_min), device)
    return Speculation(config, DraftModelProposer(draft_runner, table_group), device, draft_cost)
