"""Pipeline stages' layers (parallel/stage_split.py) against every possible split."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinymlx.parallel.stage_split import split_layers


def every_split(num_layers: int, num_stages: int):
    for cuts in itertools.combinations(range(1, num_layers), num_stages - 1):
        bounds = (0, *cuts, num_layers)
        yield tuple(range(a, b) for a, b in itertools.pairwise(bounds))


def costliest(ranges, costs, first_extra, last_extra) -> int:
    stage_costs = [sum(costs[i] for i in r) for r in ranges]
    stage_costs[0] += first_extra
    stage_costs[-1] += last_extra
    return max(stage_costs)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=1, max_size=9), st.integers(1, 4), st.integers(0, 300),
       st.integers(0, 300))
def test_the_split_covers_every_layer_in_order_and_its_costliest_stage_is_the_least_possible(
        costs, num_stages, first_extra, last_extra):
    if len(costs) < num_stages:
        return
    ranges = split_layers(costs, num_stages, first_extra, last_extra)
    assert len(ranges) == num_stages and all(len(r) for r in ranges)
    assert [i for r in ranges for i in r] == list(range(len(costs)))
    least = min(costliest(split, costs, first_extra, last_extra) for split in every_split(len(costs), num_stages))
    assert costliest(ranges, costs, first_extra, last_extra) == least


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 100), min_size=2, max_size=9), st.integers(2, 4), st.data())
def test_with_allowed_cuts_each_stage_starts_at_one_and_the_split_is_the_best_of_those(costs, num_stages, data):
    """Where KV-shared layers must stay with their source, only some layers may start a stage."""
    if len(costs) < num_stages:
        return
    cuts = set(data.draw(st.lists(st.integers(1, len(costs) - 1), max_size=len(costs))))
    allowed = [split for split in every_split(len(costs), num_stages) if all(r.start in cuts for r in split[1:])]
    if not allowed:
        with pytest.raises(ValueError, match="that keep every KV-shared layer with the layer whose K/V it reads"):
            split_layers(costs, num_stages, cuts=cuts)
        return
    ranges = split_layers(costs, num_stages, cuts=cuts)
    assert all(r.start in cuts for r in ranges[1:])
    assert costliest(ranges, costs, 0, 0) == min(costliest(split, costs, 0, 0) for split in allowed)


def test_equal_layers_split_evenly_and_uneven_counts_differ_by_one():
    assert split_layers([1] * 24, 2) == (range(0, 12), range(12, 24))
    assert sorted(len(r) for r in split_layers([1] * 7, 3)) == [2, 2, 3]


def test_the_ends_weigh_on_their_stages():
    """A large tied embedding on the first stage and head on the last push layers toward the middle."""
    first, middle, last = (len(r) for r in split_layers([10] * 12, 3, first_extra=40, last_extra=40))
    assert max(40 + 10 * first, 10 * middle, 40 + 10 * last) == 70  # 4 layers each would cost 80 at the ends
    assert middle > max(first, last)


def test_more_stages_than_layers_is_refused_with_the_largest_that_works():
    with pytest.raises(ValueError, match=r"2 decoder layers cannot fill 3 pipeline stages.*at most 2"):
        split_layers([5, 5], 3)
