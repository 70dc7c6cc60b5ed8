"""StepCostCurve: the seconds a forward of N rows takes on this machine, learned from the steps it runs.

The draft planner weighs a draft's expected tokens against the rows it adds to the step. A table measured
once (the chosen kernels' `step_cost`: ops/portable.py, ops/cpu/linear.py) gives the curve's shape; each
timed step then corrects it where it ran:

    seconds(rows) = prior(rows) * correction(rows)

`correction` is a running average of measured / prior kept per row count (past 64, per power of two),
read piecewise-linearly between the counts measured. Before the first step the curve is the prior
itself (in units of one row). Below every count measured the correction is the lowest's; past every
one, a step costs the highest's seconds plus only OPTIMISM of the increase the prior puts between them.
That last part is how the planner finds out: a plan reaching past the rows it has run looks a little
cheaper than the table says, so it gets tried once and measured, after which that count's own timings
rule. Without it a pessimistic table (a CPU's, on a bigger model than it was measured on) would keep
the planner from ever drafting, and so from ever learning that it pays.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

EXACT_ROWS = 64  # row counts kept one by one; above, in power-of-two buckets
OPTIMISM = 0.5  # share of the prior's increase charged for rows past every count measured


@dataclass
class StepCostCurve:
    prior: Callable[[int], float]  # relative cost of a step of N rows (prior(1) == 1.0)
    smoothing: float = 0.2  # weight of each new measurement in a running average (the machine drifts)
    _ratio: dict[int, float] = field(default_factory=dict)  # bucket -> running average of measured / prior
    _count: dict[int, int] = field(default_factory=dict)  # bucket -> measurements
    _seconds: dict[int, float] = field(default_factory=dict)  # memo of seconds(), cleared by each measurement
    num_observations: int = 0

    def observe(self, rows: int, seconds: float) -> None:
        """A step of `rows` rows took `seconds`."""
        if rows < 1 or seconds <= 0:
            return
        ratio = seconds / self.prior(rows)
        key = _bucket(rows)
        n = self._count.get(key, 0)
        # The first measurements of a count are averaged plainly, later ones smoothed.
        weight = max(self.smoothing, 1 / (n + 1))
        self._ratio[key] = ratio if n == 0 else (1 - weight) * self._ratio[key] + weight * ratio
        self._count[key] = n + 1
        self.num_observations += 1
        self._seconds.clear()

    def seconds(self, rows: int) -> float:
        """Expected seconds of a step of `rows` rows (before any measurement: prior units)."""
        if rows not in self._seconds:  # the planner asks for the same few counts many times a step
            self._seconds[rows] = self._estimate(rows)
        return self._seconds[rows]

    def points(self) -> dict[int, float]:
        """The row counts measured (bucket keys) and their expected seconds now, for reports."""
        return {key: self.seconds(key) for key in sorted(self._count)}

    def _estimate(self, rows: int) -> float:
        if not self._ratio:
            return self.prior(rows)
        keys = sorted(self._ratio)
        i = bisect.bisect_left(keys, rows)
        if i < len(keys) and keys[i] == rows or i == 0:
            return self.prior(rows) * self._ratio[keys[i]]
        if i == len(keys):
            lo = keys[-1]
            if _bucket(rows) == lo:  # past the bucket's key, inside the bucket measured
                return self.prior(rows) * self._ratio[lo]
            return self.prior(lo) * self._ratio[lo] * (1 + OPTIMISM * (self.prior(rows) / self.prior(lo) - 1))
        lo, hi = keys[i - 1], keys[i]
        return self.prior(rows) * (self._ratio[lo] + (self._ratio[hi] - self._ratio[lo]) * (rows - lo) / (hi - lo))


def _bucket(rows: int) -> int:
    """Row counts up to EXACT_ROWS one by one (costs have kinks there: BLAS blocking), then powers of two."""
    return rows if rows <= EXACT_ROWS else 1 << round(math.log2(rows))
