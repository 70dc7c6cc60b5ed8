import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from tinymlx.core.sampling_params import SamplingParams as SP
from tinymlx.sample.sampler import FILTER_HEAD, Sampler, SampleRequest, apply_penalties, draw

sampler = Sampler()


def req(prompt=(), output=(), **params) -> SampleRequest:
    return SampleRequest(SP(**params), list(prompt), list(output))


def tokens(logits: np.ndarray, rows) -> list[int]:
    return sampler(mx.array(logits), rows).token_ids


# ---- numpy references ----------------------------------------------------------------------------


def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def np_penalised(logits: np.ndarray, r: SampleRequest) -> np.ndarray:
    x, p = logits.astype(np.float64).copy(), r.params
    for t in set(r.prompt_token_ids) | set(r.output_token_ids):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    counts = np.bincount(np.asarray(r.output_token_ids, dtype=np.int64), minlength=len(x))
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def np_allowed(logits: np.ndarray, p: SP) -> np.ndarray:
    """Tokens min-p, then top-k, then top-p let through (vLLM's order), as a boolean mask."""
    probs = np_softmax(logits.astype(np.float64) / p.temperature)
    keep = probs >= p.min_p * probs.max()
    order = np.argsort(-probs, kind="stable")
    if p.top_k > 0:
        keep[order[p.top_k :]] = False
    kept = np.where(keep, probs, 0.0)[order]
    above = np.cumsum(kept) - kept
    keep[order[above >= p.top_p * kept.sum()]] = False
    return keep


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ---- greedy -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_greedy_is_argmax(dtype):
    logits = np.random.default_rng(0).normal(size=(16, 5000)).astype(np.float32)
    x = mx.array(logits).astype(dtype)
    out = sampler(x, [req(temperature=0) for _ in range(16)])
    assert out.token_ids == np.argmax(np.array(x.astype(mx.float32)), axis=-1).tolist()
    assert out.logprobs == [None] * 16


@pytest.mark.parametrize("temperature", [0.5, 1.0, 5.0])
def test_top_k_1_is_greedy(temperature):
    logits = np.random.default_rng(1).normal(size=(8, 3000)).astype(np.float32)
    for _ in range(5):
        got = tokens(logits, [req(temperature=temperature, top_k=1) for _ in range(8)])
        assert got == np.argmax(logits, axis=-1).tolist()


def test_rows_must_match_logits():
    with pytest.raises(ValueError, match="2 sample requests for 3 rows"):
        sampler(mx.zeros((3, 10)), [req(), req()])
    assert sampler(mx.zeros((0, 10)), []) == ([], [])


# ---- filters ------------------------------------------------------------------------------------

FILTERS = [
    dict(temperature=1.0, top_k=12),
    dict(temperature=0.8, top_p=0.6),
    dict(temperature=1.2, min_p=0.2),
    dict(temperature=0.9, top_k=30, top_p=0.7, min_p=0.05),
    dict(temperature=2.0, top_p=0.3, min_p=0.02),
]


@pytest.mark.parametrize("params", FILTERS, ids=str)
@pytest.mark.parametrize("vocab", [1000, 3 * FILTER_HEAD])
def test_filters_never_emit_a_token_outside_the_allowed_set(params, vocab):
    mx.random.seed(0)
    row = (np.random.default_rng(2).normal(size=vocab) * 2.5).astype(np.float32)
    allowed = np_allowed(row, SP(**params))
    assert 1 < allowed.sum() < 400, "the reference set should be narrow enough to mean something"
    B, calls = 64, 10
    drawn = np.array([tokens(np.tile(row, (B, 1)), [req(**params)] * B) for _ in range(calls)]).ravel()
    assert allowed[drawn].all(), f"emitted {sorted(set(drawn[~allowed[drawn]]))}"
    # ... and the filter isn't stricter than the reference: every likely allowed token shows up.
    probs = np.where(allowed, np_softmax(row / params["temperature"]), 0.0)
    likely = np.flatnonzero(probs / probs.sum() > 0.02)
    assert set(likely) <= set(drawn.tolist())


def test_nucleus_wider_than_the_head_is_cut_at_the_head():
    mx.random.seed(1)
    row = np.random.default_rng(3).normal(size=20 * FILTER_HEAD).astype(np.float32) * 0.1  # nearly flat
    assert np_allowed(row, SP(top_p=0.9)).sum() > FILTER_HEAD
    head = set(np.argsort(-row)[:FILTER_HEAD].tolist())
    drawn = tokens(np.tile(row, (64, 1)), [req(top_p=0.9)] * 64)
    assert set(drawn) <= head


def test_temperature_matches_softmax():
    logits = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0], dtype=np.float32)
    B, T = 1000, 0.7
    counts = np.zeros(len(logits))
    for step in range(4):  # distinct seeds and steps: deterministic, independent draws
        rows = [req(output=[0] * step, temperature=T, seed=i) for i in range(B)]
        np.add.at(counts, tokens(np.tile(logits, (B, 1)), rows), 1)
    critical = 24.32  # chi-square, 7 degrees of freedom, p = 0.001
    assert chi_square(counts, np_softmax(logits / T)) < critical
    assert chi_square(counts, np_softmax(logits)) > critical  # the test can tell T=0.7 from T=1


def test_top_p_renormalises_within_the_nucleus():
    mx.random.seed(2)
    logits = np.array([1.0, 0.8, 0.6, 0.4, 0.2, -2.0, -3.0, -4.0], dtype=np.float32)
    p = SP(top_p=0.8)
    allowed = np_allowed(logits, p)
    B = 1000
    counts = np.zeros(len(logits))
    for _ in range(4):
        np.add.at(counts, tokens(np.tile(logits, (B, 1)), [SampleRequest(p, [], [])] * B), 1)
    assert counts[~allowed].sum() == 0
    probs = np_softmax(logits[allowed])
    assert chi_square(counts[allowed], probs) < 18.47  # 4 degrees of freedom, p = 0.001


def test_draw_resolves_a_tail_a_single_float32_cdf_cannot():
    # One token holds ~99.8% of the mass; 150k tokens of 1e-8 each sit below float32 resolution of
    # a CDF that has already reached 1.0, yet together they hold 0.15% and must stay reachable.
    V = 150_001
    e = np.full((1, V), 1e-8, dtype=np.float32)
    e[0, 0] = 1.0
    tail_mass = (V - 1) * 1e-8
    cut = 1.0 / (1.0 + tail_mass)  # u below this picks token 0, above it the tail
    picks = [np.array(draw(mx.array(e), mx.array([[u, 0.5]])))[0] for u in (cut - 1e-4, cut + 5e-4, 0.99999)]
    assert picks[0] == 0 and picks[1] > 0 and picks[2] > V // 2
    zero = np.array([[0.0, 2.0, 0.0, 0.0, 1.0, 0.0]], dtype=np.float32)  # zero mass is never drawn
    got = {
        int(np.array(draw(mx.array(zero), mx.array([[u, v]])))[0])
        for u in np.linspace(0, 0.999, 7)
        for v in (0, 0.999)
    }
    assert got == {1, 4}


# ---- penalties ----------------------------------------------------------------------------------


def penalty_rows(rng: np.random.Generator) -> list[SampleRequest]:
    def ids(n):
        return rng.integers(0, 40, size=n).tolist()  # a small range: plenty of repeats and overlaps

    return [
        req(ids(10), ids(12)),
        req(ids(10), ids(12), repetition_penalty=1.3),
        req(ids(10), ids(12), repetition_penalty=0.7),
        req(ids(10), ids(12), presence_penalty=1.5, frequency_penalty=0.5),
        req(ids(10), ids(12), presence_penalty=-1.0, frequency_penalty=-0.25),
        req(ids(10), [], repetition_penalty=1.5, frequency_penalty=2.0),
        req([], ids(30), repetition_penalty=2.0, presence_penalty=2.0, frequency_penalty=1.0),
    ]


def test_penalties_match_numpy_reference():
    rng = np.random.default_rng(4)
    V = 300
    rows = penalty_rows(rng)
    logits = rng.normal(size=(len(rows), V)).astype(np.float32) * 3
    x = mx.array(logits)
    got = np.array(apply_penalties(x, rows))
    want = np.stack([np_penalised(logits[i], r) for i, r in enumerate(rows)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    assert not np.allclose(got, logits), "the penalties should change something"
    np.testing.assert_array_equal(np.array(x), logits)  # the caller's logits are untouched


def test_greedy_rows_pick_the_argmax_of_the_penalised_logits():
    rng = np.random.default_rng(5)
    V, changed = 60, 0
    for _ in range(10):
        rows = [r._replace(params=dataclasses.replace(r.params, temperature=0)) for r in penalty_rows(rng)]
        logits = rng.normal(size=(len(rows), V)).astype(np.float32) * 2
        want = [int(np.argmax(np_penalised(logits[i], r))) for i, r in enumerate(rows)]
        assert tokens(logits, rows) == want
        changed += sum(w != a for w, a in zip(want, np.argmax(logits, axis=-1)))
    assert changed > 5, "the penalties should flip some argmaxes"


# ---- seeds --------------------------------------------------------------------------------------


def test_seeded_row_ignores_its_batch_neighbours_and_position():
    rng = np.random.default_rng(6)
    V = 1000
    row = rng.normal(size=V).astype(np.float32) * 2
    seeded = dict(temperature=1.0, top_p=0.95, seed=1234)

    def run(index: int, neighbours: bool, step: int) -> int:
        out = rng.integers(0, V, size=step).tolist()
        rows = [
            req(temperature=0),
            req(temperature=0.7, top_k=5),
            req([1, 2], [3], temperature=1.0, repetition_penalty=1.2, seed=7),
            req(temperature=1.5, min_p=0.1, logprobs=3),
            req(out, temperature=0.5, frequency_penalty=1.0),
            req(temperature=1.0, seed=99),
            req(temperature=0),
        ]
        if not neighbours:
            rows, index = [], 0
        rows.insert(index, req([5, 6], out, **seeded))
        logits = rng.normal(size=(len(rows), V)).astype(np.float32) * 2
        logits[index] = row
        return tokens(logits, rows)[index]

    alone = [run(0, False, step) for step in range(12)]
    assert len(set(alone)) > 3, "a seeded row should still vary from step to step"
    assert [run(0, True, step) for step in range(12)] == alone
    assert [run(5, True, step) for step in range(12)] == alone
    other_seed = [tokens(row[None], [req(output=[0] * s, **{**seeded, "seed": 4321})])[0] for s in range(12)]
    assert other_seed != alone


# ---- logprobs -----------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_the_raw_logits_with_sorted_top_n():
    rng = np.random.default_rng(7)
    V = 500
    rows = [
        req(temperature=0, logprobs=5),
        req(temperature=0.7, logprobs=0),
        req([1, 2, 3], [4, 4], temperature=1.3, top_p=0.9, repetition_penalty=1.5, logprobs=20),
        req(temperature=0),
        req([9], [9, 9], temperature=0, frequency_penalty=2.0, logprobs=2),
    ]
    logits = rng.normal(size=(len(rows), V)).astype(np.float32) * 3
    out = sampler(mx.array(logits), rows)
    assert out.logprobs[3] is None
    for i, r in enumerate(rows):
        if r.params.logprobs is None:
            continue
        lp, ref = out.logprobs[i], np_log_softmax(logits[i])
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(ref[lp.token_id], abs=1e-4)
        n = r.params.logprobs
        assert [t for t, _ in lp.top] == np.argsort(-ref)[:n].tolist()
        np.testing.assert_allclose([v for _, v in lp.top], np.sort(ref)[::-1][:n], atol=1e-4)
        assert all(a >= b for (_, a), (_, b) in zip(lp.top, lp.top[1:]))


# ---- everything at once -------------------------------------------------------------------------


def test_mixed_batch_in_one_call():
    rng = np.random.default_rng(8)
    V = 800
    rows = [
        req(temperature=0),
        req(temperature=0.9, top_k=20, seed=11),
        req([3, 4, 5], [6, 6, 7], temperature=0, repetition_penalty=1.4, presence_penalty=0.5),
        req(temperature=1.1, top_p=0.5, min_p=0.05),
        req([1], [2, 2, 2], temperature=0.8, frequency_penalty=1.5, seed=12, logprobs=1),
        req(temperature=0, logprobs=0),
    ]
    logits = rng.normal(size=(len(rows), V)).astype(np.float32) * 2
    out = sampler(mx.array(logits), rows)
    for i in (0, 2, 5):
        assert out.token_ids[i] == int(np.argmax(np_penalised(logits[i], rows[i])))
    for i in (1, 3, 4):
        assert np_allowed(np_penalised(logits[i], rows[i]).astype(np.float32), rows[i].params)[
            out.token_ids[i]
        ]
    for i in (1, 4):  # seeded rows: the same token when sampled alone
        assert tokens(logits[i : i + 1], [rows[i]]) == [out.token_ids[i]]
    assert [lp is None for lp in out.logprobs] == [True, True, True, True, False, False]
