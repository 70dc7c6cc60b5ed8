"""Speculative decoding: the output is the same with and without it, only the number of steps changes.

Tiny random models, both proposers (n-gram prompt lookup; a draft model, here another tiny model or
the target itself), every sampling mode; then the acceptance rule's distribution, stops inside an
accepted run, and bad configurations.
"""

from __future__ import annotations

import math
import re

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import ByteTokenizer, run_to_completion, save_byte_tokenizer, save_dir, tiny_model

from tinymlx import Engine, EngineConfig, SamplingParams
from tinymlx.cli import main
from tinymlx.core.speculative_config import SpeculativeConfig
from tinymlx.sample.sampler import Sampler, SampleRequest
from tinymlx.speculative.speculation import accept

TARGET_SEED, OTHER_SEED = 0, 5


def engine(speculative: str | None = None, **config) -> Engine:
    """speculative: None, "ngram", "draft:self" (the target as its own draft), "draft:other", or
    "ngram+draft:self|other" (both proposers). A draft model as big as the target never pays for itself,
    so the planner would give it no drafts: the draft-model engines here draft always (adaptive=0)."""
    config.setdefault("block_size", 4)
    config.setdefault("num_pages", 256)
    draft = None
    if speculative and "draft:" in speculative:
        draft = tiny_model(TARGET_SEED if speculative.endswith(":self") else OTHER_SEED)
        speculative += ",adaptive=0"
    return Engine(tiny_model(TARGET_SEED), ByteTokenizer(), EngineConfig(speculative=speculative, **config),
                  model_name="tiny", draft_model=draft)


def copying_workload(n: int, seed: int) -> dict[int, list[tuple]]:
    """Prompts that repeat themselves (what prompt lookup feeds on) beside random ones, some sharing
    a prefix, greedy and seeded sampling, arriving over a few steps."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, 256, 12).tolist()
    arrivals: dict[int, list[tuple]] = {}
    for i in range(n):
        piece = rng.integers(0, 256, int(rng.integers(4, 16))).tolist()
        prompt = (shared if i % 3 == 0 else []) + piece * int(rng.integers(1, 5))
        temperature, request_seed = (0.0, None) if i % 2 else (0.9, i)
        params = SamplingParams(temperature=temperature, seed=request_seed, max_tokens=int(rng.integers(4, 40)),
                                ignore_eos=True, logprobs=2 if i % 5 == 0 else None,
                                repetition_penalty=1.3 if i % 7 == 0 else 1.0)
        arrivals.setdefault(int(rng.integers(0, 4)), []).append((prompt, params, f"r{i}"))
    return arrivals


def run(arrivals: dict, speculative: str | None, **config) -> tuple[dict, Engine]:
    e = engine(speculative, **config)
    return run_to_completion(e, {step: list(items) for step, items in arrivals.items()}), e


@pytest.mark.parametrize("speculative", ["ngram", "draft:other", "draft:self", "ngram+draft:other", "ngram+draft:self"])
@pytest.mark.parametrize("config", [{}, {"num_pages": 40, "max_num_batched_tokens": 48}],
                         ids=["roomy", "tiny-pool"])
def test_speculation_changes_no_output(speculative, config):
    """Greedy and seeded sampling, penalties and logprobs, prefix hits, preemptions: token for token."""
    workload = copying_workload(18, seed=3)
    plain, _ = run(workload, None, **config)
    spec, spec_engine = run(workload, speculative, **config)
    assert spec == plain
    stats = spec_engine.stats()
    assert stats.num_draft_tokens > 0  # and, but for the unrelated random draft, some were kept
    assert stats.num_accepted_tokens > 0 or speculative == "draft:other"
    # The counts per proposer add up. With both: the unrelated random draft loses the copying sequences
    # to n-gram, the target as its own draft keeps them all (its greedy drafts are all kept).
    assert [p.name for p in stats.proposers] == speculative.split(":")[0].split("+")
    assert sum(p.num_draft_tokens for p in stats.proposers) == stats.num_draft_tokens
    assert sum(p.num_accepted_tokens for p in stats.proposers) == stats.num_accepted_tokens
    if speculative == "ngram+draft:other":
        assert all(p.num_draft_tokens > 0 for p in stats.proposers)
    if config:
        assert stats.num_preemptions > 0
    if speculative.endswith("draft:self"):  # the target as its own draft agrees on every greedy token
        greedy = {step: [(p, SamplingParams(temperature=0.0, max_tokens=s.max_tokens, ignore_eos=True), r)
                         for p, s, r in items] for step, items in workload.items()}
        _, e = run(greedy, speculative, **config)
        assert next(p for p in e.stats().proposers if p.name == "draft").acceptance_rate == 1.0


def test_speculation_saves_steps_on_copying_text():
    rng = np.random.default_rng(0)
    text = rng.integers(0, 256, 30).tolist()
    arrivals = {0: [(text * 4, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True), "copy")]}
    plain, plain_engine = run(arrivals, None)
    spec, spec_engine = run(arrivals, "ngram")
    assert spec == plain
    assert spec_engine.num_steps < plain_engine.num_steps * 0.6
    metrics = spec_engine.stats()
    assert metrics.acceptance_rate > 0.5 and metrics.mean_accepted_length > 2


def test_per_request_metrics_count_drafts_and_accepted_tokens():
    e = engine("ngram")
    text = list(range(40, 70))
    e.add_request(text * 3, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), request_id="a")
    final = None
    while e.has_unfinished_requests:
        for output in e.step():
            final = output
    m = final.metrics
    assert 0 < m.num_accepted_tokens <= m.num_draft_tokens
    assert e.stats().num_draft_tokens == m.num_draft_tokens and e.stats().num_accepted_tokens == m.num_accepted_tokens


@pytest.mark.parametrize("stop", ["token", "string", "max_tokens", "eos"])
def test_a_stop_inside_an_accepted_run_ends_the_output_where_plain_decoding_does(stop):
    """The target as its own draft accepts runs of several tokens; each kind of stop is placed in the
    middle of one. Nothing past it may come out: the output equals plain decoding's, text included."""
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    # A random model's greedy text loops; find a prompt whose output brings a new printable token
    # (so a stop on it cannot fire earlier) some way in.
    for seed in range(50):
        prompt = np.random.default_rng(seed).integers(32, 127, 40).tolist()
        tokens = run({0: [(prompt, greedy, "x")]}, None)[0]["x"]
        cuts = [i for i in range(6, 30) if 32 <= tokens[i] < 127 and tokens[i] not in tokens[:i]]
        if cuts:
            cut = cuts[0]
            break
    kwargs = {"token": {"stop_token_ids": [tokens[cut]]}, "string": {"stop": [chr(tokens[cut])]},
              "max_tokens": {"max_tokens": cut + 1}, "eos": {"ignore_eos": False}}[stop]
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 40, "ignore_eos": True, **kwargs})

    def finish(speculative: str | None):
        e = engine(speculative)
        if stop == "eos":
            e.tokenizer = e.requests.tokenizer = type("EosAt", (ByteTokenizer,), {"eos_token_ids": frozenset({tokens[cut]})})()
        e.add_request(prompt, params, request_id="x")
        final = None
        while e.has_unfinished_requests:
            for output in e.step():
                final = output
            e.check()
        assert e.kv_coordinator.num_used_pages == 0
        return final, e

    (plain, _), (spec, spec_engine) = finish(None), finish("draft:self")
    assert (spec.token_ids, spec.text, spec.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
    assert len(plain.token_ids) == cut + 1 < 40  # the stop did cut the output short
    assert spec_engine.num_steps < len(spec.token_ids) - 1  # several tokens a step: it fell inside a run


def chi_square_p_value(observed: np.ndarray, expected: np.ndarray) -> float:
    """Upper tail of the chi-square statistic (Wilson-Hilferty normal approximation)."""
    keep = expected > 0
    statistic = float((((observed - expected) ** 2)[keep] / expected[keep]).sum())
    df = int(keep.sum()) - 1
    z = ((statistic / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_the_acceptance_rule_keeps_the_target_distribution():
    """Many draws of one verification (3 positions, 2 drafts) at temperature 1: the first kept token
    follows p0, and after an accepted first draft the second follows p1. A rule that trusts drafts
    more than the target does (accept a top-2 draft outright) fails the same test."""
    rng = np.random.default_rng(0)
    V, trials = 12, 6000
    logits = rng.normal(0, 1.2, (3, V)).astype(np.float32)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    drafts = [int(np.argsort(p[0])[-2]), int(np.argsort(p[1])[-1])]  # plausible but not certain
    rows = [SampleRequest(SamplingParams(temperature=1.0, seed=t), [], drafts[:i]) for t in range(trials) for i in range(3)]
    samples = np.array(Sampler()(mx.array(np.tile(logits, (trials, 1))), rows).token_ids).reshape(trials, 3)
    kept = [accept(drafts, s.tolist()) for s in samples]

    first = np.bincount([k[0] for k in kept], minlength=V)
    assert chi_square_p_value(first, trials * p[0]) > 1e-3
    second = np.bincount([k[1] for k in kept if k[0] == drafts[0]], minlength=V)
    assert chi_square_p_value(second, second.sum() * p[1]) > 1e-3
    assert first[drafts[0]] / trials == pytest.approx(p[0][drafts[0]], abs=0.03)  # the acceptance rate is p(d)

    trusting = [drafts[0] if drafts[0] in np.argsort(p[0])[-2:] else k[0] for k in kept]
    assert chi_square_p_value(np.bincount(trusting, minlength=V), trials * p[0]) < 1e-6


def test_a_draft_model_with_another_vocabulary_is_refused():
    with pytest.raises(ValueError, match="vocabulary of 512 tokens, the target 300"):
        Engine(tiny_model(), ByteTokenizer(), EngineConfig(num_pages=64, speculative="draft:big"),
               draft_model=tiny_model(vocab_size=512))


@pytest.mark.parametrize(("spec", "message"), [
    ("medusa", "must be 'ngram', 'draft:<model>', 'ngram\\+draft:<model>' or 'mtp\\[:k\\]'"),
    ("draft:", "needs a model"),
    ("ngram+draft:", "needs a model"),
    ("ngram:max_draft=0", "positive int"),
    ("ngram:k=4", "expected max_draft"),
    ("ngram:adaptive=2", "adaptive = 0 or 1"),
    ("ngram:min_n=5,max_n=3", "min_n"),
])
def test_bad_speculative_settings_fail_at_configuration(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative=spec)


def test_speculative_config_parses_options():
    config = SpeculativeConfig.parse("ngram:max_draft=8,max_n=5,min_n=1,adaptive=0")
    assert (config.max_draft_tokens, config.ngram_max, config.ngram_min, config.adaptive) == (8, 5, 1, False)
    assert SpeculativeConfig.parse("draft:smollm2-135m-instruct,max_draft=3").draft_model == "smollm2-135m-instruct"
    both = SpeculativeConfig.parse("ngram+draft:qwen2.5-coder-0.5b-instruct,max_draft=4,min_n=3")
    assert (both.proposers, both.draft_model, both.max_draft_tokens, both.ngram_min) == (
        ("ngram", "draft"), "qwen2.5-coder-0.5b-instruct", 4, 3)


def test_a_draft_model_with_another_tokenizer_is_refused_at_load(default_model_dir, smollm_model_dir):
    """Engine.load compares the two tokenizers before loading the draft's weights."""
    from tinymlx.text.tokenizer import Tokenizer

    config = EngineConfig(num_pages=64, speculative=f"draft:{smollm_model_dir}")
    with pytest.raises(ValueError, match="another vocabulary than the target"):
        Engine.load(default_model_dir, Tokenizer.from_dir(default_model_dir), config)


def test_generate_prints_the_acceptance_figures(tmp_path, capsys):
    model_dir = save_byte_tokenizer(save_dir(tmp_path / "tiny", tiny_model(seed=3)))
    main(["generate", "abcabcabcabcabcabcabcabc", "--raw", "--model", str(model_dir), "--speculative", "ngram",
          "--max-tokens", "24", "--num-pages", "64"])
    err = capsys.readouterr().err
    figures = re.search(r"\[speculative ngram: (\d+) drafted, (\d+) accepted \((\d+)%\), ([\d.]+) tokens per", err)
    assert figures is not None, err
    drafted, accepted = int(figures[1]), int(figures[2])
    assert drafted > 0 and 0 <= accepted <= drafted
    assert int(figures[3]) == round(100 * accepted / drafted)


def test_both_proposers_report_their_own_counts_in_stats_and_metrics():
    """ngram+draft on a prompt that repeats itself after random text: n-gram proposes where the context
    has a match and the draft model elsewhere; stats() and /metrics count each proposer's drafts apart."""
    import httpx
    from server_harness import RunningServer

    rng = np.random.default_rng(2)
    piece = rng.integers(32, 127, 12).tolist()
    prompts = [piece * 4, rng.integers(32, 127, 9).tolist()]
    e = engine("ngram+draft:other")
    running = RunningServer(e)
    try:
        for prompt in prompts:
            body = {"model": running.model, "prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True}
            assert httpx.post(f"{running.base_url}/v1/completions", json=body, timeout=60).status_code == 200
        running.wait_idle()
        stats = running.server.async_engine.stats()
        by_name = {p.name: p for p in stats.proposers}
        assert set(by_name) == {"ngram", "draft"} and all(p.num_draft_tokens for p in by_name.values())
        assert by_name["ngram"].acceptance_rate > 0.5  # the copied piece
        metrics = httpx.get(f"{running.base_url}/metrics").text
        for name, p in by_name.items():
            assert f'tinymlx_draft_tokens_total{{proposer="{name}"}} {p.num_draft_tokens}.0' in metrics
            assert f'tinymlx_accepted_draft_tokens_total{{proposer="{name}"}} {p.num_accepted_tokens}.0' in metrics
        assert stats.step_cost and all(seconds > 0 for _, seconds in stats.step_cost)  # the curve it learned
    finally:
        running.close()
