"""The step-cost curve the draft planner learns, on synthetic step timers: it converges to the machine's
curve from a prior that is wrong, and the planner, on what it learned, never takes a plan whose expected
tokens per second fall below not drafting."""

from __future__ import annotations

import numpy as np
import pytest

from tinymlx.core.request import ValidRequest
from tinymlx.core.sampling_params import SamplingParams
from tinymlx.core.sequence import Sequence
from tinymlx.ops.cpu.linear import step_cost as cpu_row_cost
from tinymlx.ops.portable import step_cost as gpu_row_cost
from tinymlx.speculative.speculation import DraftPlanner
from tinymlx.speculative.step_cost import StepCostCurve

# Machines whose costs the prior does not know: seconds of a step of N rows.
MACHINES = {
    "flat gpu": lambda rows: 0.020 + 0.0001 * rows,  # weights read once: rows nearly free
    "steep cpu": lambda rows: 0.050 * rows ** 0.9,  # compute-bound from the first row
    "knee at 16": lambda rows: 0.1 * (1 + 0.02 * min(rows, 16) + 0.3 * max(0, rows - 16)),
}


def run_steps(curve: StepCostCurve, machine, rng: np.random.Generator, num_steps: int = 400) -> None:
    """Steps of the row counts a serving engine runs (decode batches plus drafts, now and then a prefill
    chunk), each timed with 5% noise."""
    for _ in range(num_steps):
        rows = int(rng.choice([rng.integers(1, 65), rng.integers(1, 9), rng.integers(64, 513)], p=[0.6, 0.3, 0.1]))
        curve.observe(rows, machine(rows) * rng.normal(1.0, 0.05))


@pytest.mark.parametrize("prior", [cpu_row_cost, gpu_row_cost], ids=["cpu prior", "gpu prior"])
@pytest.mark.parametrize("name", list(MACHINES))
def test_the_curve_converges_to_the_machine_from_either_prior(name, prior):
    machine, curve = MACHINES[name], StepCostCurve(prior)
    assert curve.seconds(8) == pytest.approx(prior(8))  # nothing timed yet: the prior, in units of one row
    run_steps(curve, machine, np.random.default_rng(0))
    for rows in (1, 2, 4, 8, 12, 16, 24, 40, 64):
        assert curve.seconds(rows) == pytest.approx(machine(rows), rel=0.1), rows
    # Relative costs, what the planner weighs: within 10% too.
    assert curve.seconds(40) / curve.seconds(8) == pytest.approx(machine(40) / machine(8), rel=0.1)


def test_rows_never_run_are_priced_from_the_buckets_measured_around_them():
    """Timed only at 8 and 16 rows on a machine twice as slow as the prior: 12 rows, never run, is the
    prior's 12 at the same factor; 1 row, below every count run, too; 24 rows, past them, costs what 16
    did plus half the prior's increase from 16 to 24 (so a plan reaching it gets tried and measured)."""
    curve, scale = StepCostCurve(cpu_row_cost), 2 * 0.01
    for _ in range(10):
        curve.observe(8, scale * cpu_row_cost(8))
        curve.observe(16, scale * cpu_row_cost(16))
    assert curve.seconds(12) == pytest.approx(scale * cpu_row_cost(12))
    assert curve.seconds(1) == pytest.approx(scale * cpu_row_cost(1))
    past = scale * cpu_row_cost(16) * (1 + 0.5 * (cpu_row_cost(24) / cpu_row_cost(16) - 1))
    assert curve.seconds(24) == pytest.approx(past)
    assert scale * cpu_row_cost(16) < curve.seconds(24) < scale * cpu_row_cost(24)
    assert set(curve.points()) == {8, 16}
    curve.observe(24, scale * cpu_row_cost(24))  # tried: measured now
    assert curve.seconds(24) == pytest.approx(scale * cpu_row_cost(24))
    assert curve.seconds(20) == pytest.approx(scale * cpu_row_cost(20))


def test_a_pessimistic_table_does_not_keep_the_planner_from_finding_cheap_rows():
    """The CPU table says 2 rows cost 1.33x of one; this machine's cost 1.1x. A single stream whose
    drafts are kept 60% of the time: on the table alone a draft would not pay (1.6 tokens for 1.33 +
    the draft's 0.35), but the first plan tries one, the step is timed, and drafting goes on."""
    machine = lambda rows: 0.5 * (1 + 0.1 * (rows - 1))  # noqa: E731
    curve = StepCostCurve(cpu_row_cost)
    curve.observe(1, machine(1))
    planner = DraftPlanner(max_draft_tokens=1, target_cost=curve, draft_cost=lambda rows: 0.35 * 0.5)
    seq = Sequence(0, ValidRequest([1, 2, 3], SamplingParams(), request_id="r"))
    planner._rates[0, "draft"] = 0.6
    assert 1.6 / (0.5 * cpu_row_cost(2) + 0.35 * 0.5) < 1 / 0.5  # the table alone: not worth it
    for _ in range(5):
        plan = planner.plan([seq], {0: 1}, {0: "draft"})
        assert plan == {0: 1}
        curve.observe(1 + plan[0], machine(1 + plan[0]))
        planner._rates[0, "draft"] = 0.6


def test_rows_past_a_bucket_key_inside_the_bucket_are_priced_as_measured():
    """Past 64 rows counts share power-of-two buckets: 150 rows falls in the bucket of 128 measured,
    so it is priced at that bucket's correction, not extrapolated as if never run."""
    curve = StepCostCurve(cpu_row_cost)
    for _ in range(5):
        curve.observe(120, 3 * cpu_row_cost(120))
    assert set(curve.points()) == {128}
    assert curve.seconds(150) == pytest.approx(3 * cpu_row_cost(150))
    assert curve.seconds(200) < 3 * cpu_row_cost(200)  # the next bucket, never run: optimistic


def test_a_batch_mixing_proposers_fills_the_cheap_drafts_first():
    """Four chats the draft model would have to catch up on (a 200-token prompt each, never seen) come
    first in the batch, four code edits with n-gram proposals after them, all kept 90% of the time. The
    catch-up makes the draft model's drafts a loss this step; the n-gram drafts still pay and are taken."""
    machine = lambda rows: 0.1 * (1 + 0.05 * (rows - 1))  # noqa: E731
    planner = DraftPlanner(max_draft_tokens=4, target_cost=StepCostCurve(machine),
                           draft_cost=lambda rows: 0.004 * rows)
    seqs = [Sequence(i, ValidRequest(list(range(200)), SamplingParams(), request_id="r")) for i in range(8)]
    sources = {i: "draft" if i < 4 else "ngram" for i in range(8)}
    for i, source in sources.items():
        planner._rates[i, source] = 0.9
    plan = planner.plan(seqs, dict.fromkeys(sources, 4), sources)
    assert all(plan[i] == 0 for i in range(4)) and all(plan[i] == 4 for i in range(4, 8))
    rates = dict.fromkeys(sources, 0.9)
    assert expected_tokens_per_s(plan, rates, machine) > 1.5 * expected_tokens_per_s(dict.fromkeys(sources, 0),
                                                                                      rates, machine)


def test_the_curve_follows_a_machine_that_slows_down():
    """A machine whose steps become 50% slower (another job took a core): the curve follows within 30 steps."""
    curve = StepCostCurve(cpu_row_cost)
    for _ in range(100):
        curve.observe(8, 0.1)
    for _ in range(30):
        curve.observe(8, 0.15)
    assert curve.seconds(8) == pytest.approx(0.15, rel=0.02)


def expected_tokens_per_s(plan: dict[int, int], rates: dict[int, float], machine) -> float:
    tokens = sum(1 + sum(rates[i] ** k for k in range(1, n + 1)) for i, n in plan.items())
    return tokens / machine(len(plan) + sum(plan.values()))


@pytest.mark.parametrize("name", list(MACHINES))
@pytest.mark.parametrize("batch", [1, 4, 16])
def test_the_planner_on_what_it_learned_never_drafts_below_not_drafting(name, batch):
    """For sequences of known acceptance rates, the plan on the learned curve yields, on the machine's
    true curve, the expected tokens per second of not drafting at least, and nearly those of the plan on
    the true curve itself (both within the 5% noise of the timings it learned from: 2% and 5%)."""
    machine, rng = MACHINES[name], np.random.default_rng(batch)
    curve = StepCostCurve(cpu_row_cost)
    run_steps(curve, machine, rng)
    learned = DraftPlanner(max_draft_tokens=6, target_cost=curve)
    exact = DraftPlanner(max_draft_tokens=6, target_cost=StepCostCurve(machine))  # nothing timed: the curve itself
    for _ in range(20):
        seqs = [Sequence(i, ValidRequest([1, 2, 3], SamplingParams(), request_id="r")) for i in range(batch)]
        rates = {s.seq_id: float(r) for s, r in zip(seqs, rng.uniform(0.0, 0.95, batch))}
        plans = []
        for planner in (learned, exact):
            for seq_id, rate in rates.items():
                planner._rates[seq_id, "ngram"] = rate
            plans.append(planner.plan(seqs, dict.fromkeys(rates, 6), dict.fromkeys(rates, "ngram")))
        on_learned, best = (expected_tokens_per_s(plan, rates, machine) for plan in plans)
        assert on_learned >= 0.98 * expected_tokens_per_s(dict.fromkeys(rates, 0), rates, machine)
        assert on_learned >= 0.95 * best
