"""Speculative decoding on hybrid recurrent targets (Qwen3.5, Qwen3.5-MoE, Qwen3-Next): a verified chunk
keeps the state after each of its positions in a snapshot slot, and commit makes the one after the last
kept token live (kv/state_slots.py). Every proposer changes no token, greedy or seeded, batched, with
prefix hits and preemption; an adversarial proposer whose drafts go wrong at every position in turn
proves that each snapshot is the state it stands for. Every step is checked, and no state slot leaks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hybrid_checkpoints import hf_checkpoint
from tiny_models import ByteTokenizer, run_outputs, run_to_completion, tiny_model

from tinymlx import Engine, EngineConfig, SamplingParams
from tinymlx.core.batch import ScheduledChunk
from tinymlx.core.sequence import Sequence
from tinymlx.models import load_model

pytest.importorskip("torch")
pytest.importorskip("transformers")

HYBRIDS = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"]
MAX_DRAFT = 3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    paths = {}
    for variant in HYBRIDS:
        paths[variant] = tmp_path_factory.mktemp(variant) / "m"
        hf_checkpoint(paths[variant], variant)
    return paths


def engine(model_dir: Path, speculative: str | None = None, **config) -> Engine:
    """The draft model is a tiny full-attention model of the same vocabulary. Drafting always (adaptive=0:
    the planner would give an unrelated random draft no drafts), n-gram from a one-token match (min_n=1: a
    random model's output seldom repeats two)."""
    settings = dict(block_size=4, num_pages=256, max_num_batched_tokens=32, enable_prefix_caching=True)
    draft = tiny_model(5) if speculative and "draft" in speculative else None
    if speculative:
        speculative += (":tiny," if speculative.endswith("draft") else ":") + f"max_draft={MAX_DRAFT},min_n=1,adaptive=0"
    return Engine(load_model(model_dir, dtype="float32"), ByteTokenizer(),
                  EngineConfig(speculative=speculative, **{**settings, **config}), draft_model=draft)


def workload(n: int = 10, seed: int = 3) -> dict[int, list[tuple]]:
    """Prompts that repeat a piece (what n-gram lookup feeds on), half of them after a shared 24-token
    prefix (prefix hits from its checkpoints), greedy and seeded sampling, arriving over four steps."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 256, 24).tolist()
    arrivals: dict[int, list[tuple]] = {}
    for i in range(n):
        piece = rng.integers(0, 256, int(rng.integers(3, 8))).tolist()
        prompt = (shared if i % 2 else []) + piece * int(rng.integers(2, 5))
        temperature, request_seed = (0.0, None) if i % 3 else (0.9, i)
        params = SamplingParams(temperature=temperature, seed=request_seed, max_tokens=int(rng.integers(6, 20)),
                                ignore_eos=True)
        arrivals.setdefault(0 if i < 2 else int(rng.integers(1, 4)), []).append((prompt, params, f"r{i}"))
    return arrivals


def copy_of(arrivals: dict[int, list[tuple]]) -> dict[int, list[tuple]]:
    return {step: list(items) for step, items in arrivals.items()}


# The proposers differ only before the forward: one family runs all three, every family n-gram.
CASES = [(variant, "ngram") for variant in HYBRIDS] + [("qwen3_5_text", "draft"), ("qwen3_5_text", "ngram+draft")]


@pytest.mark.parametrize(("variant", "speculative"), CASES)
@pytest.mark.parametrize("pool", ["roomy", "small"])
def test_speculation_on_a_hybrid_target_changes_no_token(checkpoints, variant, speculative, pool):
    model_dir = checkpoints[variant]
    config = {} if pool == "roomy" else {"num_pages": 36}
    plain = run_to_completion(engine(model_dir, **config), copy_of(workload()))
    spec_engine = engine(model_dir, speculative, **config)
    assert run_to_completion(spec_engine, copy_of(workload())) == plain
    stats = spec_engine.stats()
    # Random weights keep few drafts: rejected ones roll states back here; the adversary below keeps some.
    assert stats.num_draft_tokens > stats.num_accepted_tokens
    assert stats.state_slots.num_resumed > 0  # prefix hits resumed from checkpoints
    assert stats.state_slots.num_live_used == 0  # every live and snapshot slot came back
    if pool == "small":
        assert stats.num_preemptions > 0


class WrongAtEveryPosition:
    """A proposer that knows each request's plain output and drafts it with one token wrong: the first at
    the first draft, then the second, ..., then none wrong, round and round, so a verified chunk is
    rolled back to each of its snapshots in turn (and kept whole)."""

    def __init__(self, outputs: dict[tuple[int, ...], list[int]]):
        self.outputs = outputs  # prompt -> the tokens plain decoding gives
        self.turn = 0
        self.num_rejected_at = [0] * (MAX_DRAFT + 1)  # how many chunks had their first wrong draft at i

    def available(self, seq: Sequence, limit: int) -> int:
        return limit

    def propose(self, chunks: list[ScheduledChunk], seqs: dict[int, Sequence]) -> dict[int, list[int]]:
        drafts = {}
        for chunk in chunks:
            seq = seqs[chunk.seq_id]
            output = self.outputs[tuple(seq.token_ids[:seq.num_prompt_tokens])]
            done = seq.num_tokens - seq.num_prompt_tokens
            right = output[done:done + chunk.num_draft_tokens]
            wrong_at = self.turn % (MAX_DRAFT + 1)
            self.turn += 1
            if wrong_at < len(right):
                right[wrong_at] = (right[wrong_at] + 1) % 256
            self.num_rejected_at[min(wrong_at, len(right))] += 1
            drafts[chunk.seq_id] = right
        return drafts

    def committed(self, seq_id: int, num_computed_tokens: int) -> None:
        pass

    def forget(self, seq_id: int) -> None:
        pass


@pytest.mark.parametrize("variant", HYBRIDS)
def test_drafts_rejected_at_every_position_roll_the_state_back_exactly(checkpoints, variant):
    model_dir = checkpoints[variant]
    arrivals = workload(8, seed=4)
    plain = run_outputs(engine(model_dir), copy_of(arrivals))
    prompts = {request_id: prompt for items in arrivals.values() for prompt, _, request_id in items}
    adversary = WrongAtEveryPosition({tuple(prompts[r]): out.token_ids for r, out in plain.items()})
    spec_engine = engine(model_dir, "ngram")
    spec_engine.speculation.proposers["ngram"] = adversary
    outputs = run_to_completion(spec_engine, copy_of(arrivals))
    assert outputs == {request_id: out.token_ids for request_id, out in plain.items()}
    assert all(adversary.num_rejected_at)  # a rejection at every draft position, and chunks kept whole
    stats = spec_engine.stats()
    assert stats.num_accepted_tokens < stats.num_draft_tokens and stats.state_slots.num_live_used == 0


def test_snapshot_slots_are_counted_in_the_pool(checkpoints):
    model_dir = checkpoints["qwen3_5_text"]
    plain, spec = engine(model_dir, max_num_seqs=4), engine(model_dir, "ngram", max_num_seqs=4)
    per_slot = plain.stats().state_slots.slot_nbytes
    assert spec.config.num_state_slots - plain.config.num_state_slots == 4 * MAX_DRAFT
    assert spec.stats().state_slots.nbytes - plain.stats().state_slots.nbytes == 4 * MAX_DRAFT * per_slot
    # A budget the plain engine's slots fit but not the snapshots too: refused, naming what to lower.
    budget = (plain.config.num_state_slots + 1) * per_slot  # the slots, and a few KV pages of this tiny model
    engine(model_dir, num_pages=None, kv_cache_bytes=budget, max_num_seqs=4)
    with pytest.raises(ValueError, match=r"cannot hold the recurrent state slots .* or max_draft"):
        engine(model_dir, "ngram", num_pages=None, kv_cache_bytes=budget, max_num_seqs=4)


def test_a_draft_model_with_recurrent_layers_is_refused(checkpoints):
    hybrid = load_model(checkpoints["qwen3_5_text"], dtype="float32")
    with pytest.raises(ValueError, match="a draft with only those"):
        Engine(hybrid, ByteTokenizer(), EngineConfig(block_size=4, num_pages=64, speculative="draft:d"),
               draft_model=hybrid)
