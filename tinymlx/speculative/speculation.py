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

Hybrid targets: the recurrent layers keep the state after every position of a verified chunk, in snapshot
slots taken at schedule (kv/state_slots.py); commit makes the one after the last kept token the live state.
Their cost (k + 1 state writes a layer instead of one) is in the step times the planner's curve learns.

Proposers: "ngram" (prompt lookup: free, strong where the output copies its context), "draft:<model>" (a
smaller model of the same vocabulary), or both, "ngram+draft:<model>": each step a sequence takes the n-gram
proposal when its context has a match and n-gram drafts have been kept at least as often as the draft
model's for it, and the draft model's otherwise. The planner prices each plan with the step-cost curves it
learns from the steps it times (step_cost.py), the target's and the draft model's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from tinymlx.core.batch import ScheduledBatch, ScheduledChunk, StepRecord
from tinymlx.core.outputs import ProposerStats
from tinymlx.core.sequence import Sequence
from tinymlx.core.speculative_config import SpeculativeConfig
from tinymlx.speculative.mtp import MTPProposer
from tinymlx.speculative.step_cost import StepCostCurve


def accept(drafts: list[int], samples: list[int]) -> list[int]:
    """The tokens a verified chunk keeps: samples while each agrees with the draft it checked, then
    the first that does not (or the bonus past the last draft). `samples` has len(drafts) + 1."""
    kept = []
    for i, sample in enumerate(samples):
        kept.append(sample)
        if i == len(drafts) or sample != drafts[i]:
            break
    return kept


MIN_GAIN = 0.02  # a plan must beat not drafting by this share: its costs are learned from noisy timings


@dataclass
class DraftPlanner:
    """How many drafts each decoding sequence gets this step: the plan that maximises expected
    tokens per second of step time.

    A sequence whose drafts (from the proposer it uses) have been kept at rate a yields 1 + a + a^2 + ..
    + a^k tokens from k drafts. Drafts go one at a time: per proposer, to the sequence whose next draft
    is most likely kept, and of those the one whose plan then expects more tokens per second (an n-gram
    draft adds a row; a draft model's first also adds its catch-up forward, so a batch mixing both fills
    the n-gram drafts first). The plan is cut where tokens / step seconds peaked: the target's forward
    over all rows, plus the draft model's forwards for the sequences it drafts for (the first runs the
    tokens each has not seen, its prompt the first time; the k-th, the sequences drafting at least k).
    Both costs come from curves learned from the steps timed (step_cost.py), so on a CPU, where rows are
    dear, a single stream gets several drafts and a batch of 16 almost none, and unpredictable text (low
    a) gets none either way. Not drafting is always a candidate: a plan is taken only if it expects
    MIN_GAIN more tokens per second than not drafting. The rate of a sequence not drafting drifts back
    towards the prior, so it gets tried again later.
    """

    max_draft_tokens: int
    target_cost: StepCostCurve
    draft_cost: Callable[[int], float] | None = None  # seconds of a draft-model forward of N rows
    prior: float = 0.6
    _rates: dict[tuple[int, str], float] = field(default_factory=dict)

    def rate(self, seq_id: int, proposer: str) -> float:
        return self._rates.get((seq_id, proposer), self.prior)

    def plan(self, seqs: list[Sequence], available: dict[int, int], sources: dict[int, str],
             catch_up: dict[int, int] | None = None) -> dict[int, int]:
        """`available`: drafts each sequence's proposer can give; `sources`: which proposer that is;
        `catch_up`: the tokens the draft model's first forward runs for each (what it has not seen, at
        least 1; None: it has seen none of them)."""
        rates = {s.seq_id: self._rates.setdefault((s.seq_id, sources[s.seq_id]), self.prior) for s in seqs}
        catch_up = catch_up or {s.seq_id: max(1, s.num_tokens) for s in seqs}
        drafts = dict.fromkeys(rates, 0)
        tokens, rows = float(len(seqs)), len(seqs)
        best, best_drafts = tokens / self.target_cost.seconds(rows) * (1 + MIN_GAIN), dict(drafts)

        def value_with(i: int) -> float:  # expected tokens per second once seq i has one more draft
            drafts[i] += 1
            value = (tokens + rates[i] ** drafts[i]) / (self.target_cost.seconds(rows + 1)
                                                         + self._draft_seconds(drafts, sources, catch_up))
            drafts[i] -= 1
            return value

        while True:
            by_source: dict[str, int] = {}  # each proposer's candidate: its sequence likeliest to keep a draft
            for j in drafts:
                if drafts[j] < min(available.get(j, 0), self.max_draft_tokens):
                    k = by_source.get(sources[j])
                    if k is None or rates[j] ** (drafts[j] + 1) > rates[k] ** (drafts[k] + 1):
                        by_source[sources[j]] = j
            if not by_source:
                break
            values = {i: value_with(i) for i in by_source.values()}
            i = max(values, key=values.get)
            drafts[i] += 1
            tokens += rates[i] ** drafts[i]
            rows += 1
            if values[i] > best:
                best, best_drafts = values[i], dict(drafts)
        for seq_id, n in best_drafts.items():
            if not n:  # not drafting: drift back towards the prior, to be tried again
                key = (seq_id, sources[seq_id])
                self._rates[key] += 0.05 * (self.prior - self._rates[key])
        return best_drafts

    def _draft_seconds(self, drafts: dict[int, int], sources: dict[int, str], catch_up: dict[int, int]) -> float:
        users = [seq_id for seq_id, n in drafts.items() if n and sources[seq_id] in ("draft", "mtp")]
        if self.draft_cost is None or not users:
            return 0.0
        # The first forward runs each user's unseen tokens (an MTP head's first draft is made after every
        # step anyway: no catch-up); the k-th after it, those drafting at least k.
        unseen = sum(catch_up[i] for i in users)
        first = self.draft_cost(unseen) if unseen else 0.0
        return first + sum(self.draft_cost(sum(drafts[i] >= k for i in users))
                           for k in range(2, max(drafts[i] for i in users) + 1))

    def record(self, seq_id: int, proposer: str, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            rate = self.rate(seq_id, proposer)
            self._rates[seq_id, proposer] = 0.6 * rate + 0.4 * num_accepted / num_drafts

    def forget(self, seq_id: int) -> None:
        for key in [key for key in self._rates if key[0] == seq_id]:
            del self._rates[key]


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

    def committed(self, seq_id: int, num_computed_tokens: int) -> None:
        pass  # it keeps no K/V

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
    a sequence's block table there addresses both; it holds K/V for the tokens the draft has seen
    (`num_seen`) and catches up on the rest (the prompt, verified tokens) in the first of its k forwards
    each step. What it has seen past the target's computed tokens sat in blocks given back at commit, and
    a preempted sequence's blocks are all given back: then it has seen nothing.
    """

    def __init__(self, runner, cost: StepCostCurve, table_group: int = 0):
        self.runner = runner  # a ModelRunner over the draft model, no tensor parallelism
        self.cost = cost  # learns from each forward timed here
        self.table_group = table_group
        self._seen: dict[int, tuple[int, int]] = {}  # seq -> (tokens the draft holds K/V for, preemptions then)

    def available(self, seq: Sequence, limit: int) -> int:
        return limit

    def committed(self, seq_id: int, num_computed_tokens: int) -> None:
        """The target's computed tokens after a commit: the draft's K/V past them are gone."""
        if seq_id in self._seen:
            num_seen, preemptions = self._seen[seq_id]
            self._seen[seq_id] = (min(num_seen, num_computed_tokens), preemptions)

    def forget(self, seq_id: int) -> None:
        self._seen.pop(seq_id, None)

    def num_seen(self, seq: Sequence) -> int:
        num_seen, preemptions = self._seen.get(seq.seq_id, (0, seq.num_preemptions))
        return num_seen if preemptions == seq.num_preemptions else 0

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
                start = self.num_seen(seq)
                # First forward: every token the draft has not seen, up to the last; then its own drafts.
                tokens = proposed[-1:] if proposed else seq.token_ids[start:]
                step.append(ScheduledChunk(seq_id, tokens, start, tables[seq_id], True))
                self._seen[seq_id] = (start + len(tokens), seq.num_preemptions)
            rows, start_time = sum(len(c.token_ids) for c in step), time.perf_counter()
            logits = self.runner.run(ScheduledBatch(step, rows, []))
            proposed_tokens = mx.argmax(logits, axis=-1).tolist()  # (evaluates the forward: timed in full)
            self.cost.observe(rows, time.perf_counter() - start_time)
            for seq_id, token in zip(active, proposed_tokens):
                drafts[seq_id].append(token)


class Speculation:
    """What the engine holds: the proposers, the draft planner and the step-cost curves it plans with,
    and the counters (per proposer)."""

    def __init__(self, config: SpeculativeConfig, proposers: dict[str, NgramProposer | DraftModelProposer | MTPProposer],
                 seq_of: Callable[[int], Sequence], target_cost: StepCostCurve, draft_cost: StepCostCurve | None = None,
                 draft_share: float = 0.0):
        """`seq_of`: the engine's sequence of an id. `draft_share`: a draft forward's cost as a share of the
        target's, until the draft's are timed."""
        self.config, self.proposers, self._seq_of = config, proposers, seq_of
        self.target_cost, self.draft_cost, self._draft_share = target_cost, draft_cost, draft_share
        self.planner = DraftPlanner(config.max_draft_tokens, target_cost,
                                    self._draft_seconds if draft_cost is not None else None)
        self.counts = {name: ProposerStats(name, 0, 0, 0) for name in proposers}  # replaced as they grow
        self._sources: dict[int, str] = {}  # seq -> the proposer it drafts with this step
        self._per_request: dict[int, tuple[int, int]] = {}  # seq -> (drafts verified, drafts kept)

    @property
    def runners(self) -> tuple:
        """The proposers' own model runners (a draft model's, the MTP head's): their weights and pools."""
        return tuple(p.runner for p in self.proposers.values() if isinstance(p, DraftModelProposer | MTPProposer))

    @property
    def num_draft_tokens(self) -> int:
        return sum(c.num_draft_tokens for c in self.counts.values())

    @property
    def num_accepted_tokens(self) -> int:
        return sum(c.num_accepted_tokens for c in self.counts.values())

    @property
    def num_verified_chunks(self) -> int:
        return sum(c.num_verified_chunks for c in self.counts.values())

    def plan_drafts(self, seqs: list[Sequence]) -> dict[int, int]:
        """The scheduler's hook: draft slots wanted by each decoding sequence this step. Each sequence
        drafts with the proposer whose drafts it kept most often (ties: the first, n-gram), among those
        that have a proposal for it now."""
        limit, available = self.config.max_draft_tokens, {}
        for seq in seqs:
            offers = {name: p.available(seq, limit) for name, p in self.proposers.items()}
            offers = {name: n for name, n in offers.items() if n} or {next(iter(self.proposers)): 0}
            source = max(offers, key=lambda name: self.planner.rate(seq.seq_id, name))
            self._sources[seq.seq_id], available[seq.seq_id] = source, offers[source]
        if not self.config.adaptive:
            return available
        draft = self.proposers.get("draft")
        catch_up = {s.seq_id: 0 if "mtp" in self.proposers else max(1, s.num_tokens - (draft.num_seen(s) if draft else 0))
                    for s in seqs}
        return self.planner.plan(seqs, available, self._sources, catch_up)

    # -- the step's stages (engine/stages.py) ---------------------------------------------------
    def plan(self, batch: ScheduledBatch) -> ScheduledBatch:
        """Schedule: put the proposers' drafts into the chunks the scheduler gave draft slots."""
        if not batch.num_draft_slots:
            return batch
        seqs = {c.seq_id: self._seq_of(c.seq_id) for c in batch.chunks}
        drafts: dict[int, list[int]] = {}
        for name, proposer in self.proposers.items():
            mine = [c for c in batch.chunks if c.num_draft_tokens and self._sources.get(c.seq_id) == name]
            if mine:
                drafts.update(proposer.propose(mine, seqs))
        chunks = [c.with_drafts(drafts[c.seq_id]) if c.num_draft_tokens else c for c in batch.chunks]
        return batch._replace(chunks=chunks, num_batched_tokens=sum(len(c.token_ids) for c in chunks))

    def accept(self, chunk: ScheduledChunk, samples: list[int]) -> list[int]:
        """Commit: the agreeing drafts plus one, counted for the planner, the proposer and the request."""
        drafts = chunk.draft_token_ids
        kept = accept(drafts, samples)
        self.record(chunk.seq_id, len(drafts), len(kept) - 1)
        verified, accepted = self._per_request.get(chunk.seq_id, (0, 0))
        self._per_request[chunk.seq_id] = (verified + len(drafts), accepted + len(kept) - 1)
        num_computed = chunk.start_position + (len(kept) if drafts else len(chunk.token_ids))
        for proposer in self.proposers.values():
            proposer.committed(chunk.seq_id, num_computed)
        return kept

    def observe(self, step: StepRecord) -> None:
        """The forward and sampling of a decode step (each chunk one new token, plus its drafts: the steps
        the planner plans; a prefill's rows cost otherwise) teach the target's step-cost curve."""
        chunks = step.batch.chunks
        if step.kept and all(len(c.token_ids) - c.num_draft_tokens == 1 for c in chunks):
            self.observe_step(step.batch.num_batched_tokens, step.seconds)
        for proposer in self.proposers.values():
            if isinstance(proposer, MTPProposer):  # its pass over the step's tokens
                proposer.observe(step)

    def request_counts(self, seq_id: int) -> tuple[int, int]:
        """(drafts verified, drafts kept) for one request so far."""
        return self._per_request.get(seq_id, (0, 0))

    def observe_step(self, rows: int, seconds: float) -> None:
        """The target's forward (and sampling) over `rows` rows took `seconds`: the curve learns it."""
        self.target_cost.observe(rows, seconds)

    def record(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        source = self._sources.get(seq_id, next(iter(self.proposers)))
        self.planner.record(seq_id, source, num_drafts, num_accepted)
        if num_drafts:
            c = self.counts[source]
            self.counts[source] = replace(c, num_draft_tokens=c.num_draft_tokens + num_drafts,
                                          num_accepted_tokens=c.num_accepted_tokens + num_accepted,
                                          num_verified_chunks=c.num_verified_chunks + 1)

    def forget(self, seq_id: int) -> None:
        self.planner.forget(seq_id)
        self._sources.pop(seq_id, None)
        self._per_request.pop(seq_id, None)
        for proposer in self.proposers.values():
            proposer.forget(seq_id)

    def _draft_seconds(self, rows: int) -> float:
        """A draft forward's seconds: its own curve once both have been timed, else its share of the target's."""
        if self.draft_cost.num_observations and self.target_cost.num_observations:
            return self.draft_cost.seconds(rows)
        return self._draft_share * self.target_cost.seconds(rows)


def make_speculation(config: SpeculativeConfig, row_cost: Callable[[int], float], seq_of: Callable[[int], Sequence],
                     draft_runner=None, draft_share: float = 0.0, table_group: int = 0,
                     target_runner=None) -> Speculation:
    """`draft_runner`: a ModelRunner over the draft model or the MTP head, whose forward costs about
    `draft_share` of the target's and whose pool shares the block ids of the target's KV group
    `table_group`; an MTP head reads `target_runner`'s hidden states. The step-cost curves start from
    `row_cost`, a step's time relative to one row's (the chosen kernels' `step_cost`: ops/kernels.py)."""
    proposers: dict[str, NgramProposer | DraftModelProposer | MTPProposer] = {}
    draft_cost = None
    for name in config.proposers:
        if name == "ngram":
            proposers[name] = NgramProposer(config.ngram_max, config.ngram_min)
        elif name == "mtp":
            draft_cost = StepCostCurve(row_cost)
            proposers[name] = MTPProposer(draft_runner, target_runner, seq_of, draft_cost, table_group)
        else:
            draft_cost = StepCostCurve(row_cost)
            proposers[name] = DraftModelProposer(draft_runner, draft_cost, table_group)
    return Speculation(config, proposers, seq_of, StepCostCurve(row_cost), draft_cost, draft_share)
