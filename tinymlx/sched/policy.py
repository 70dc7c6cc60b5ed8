"""Admission order for waiting sequences, and who gives way under memory pressure.

FCFS admits by arrival; strict priority by `priority` (lower first, as in vLLM), then arrival;
weighted fair queuing admits from the tenant that has received the least service per weight.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from collections.abc import Sequence as Seq

from tinymlx.core.sequence import Sequence


class FCFSPolicy:
    def select(self, waiting: Seq[Sequence]) -> Sequence:
        return min(waiting, key=lambda s: (s.arrival_time, s.seq_id))

    def select_victim(self, running: Seq[Sequence]) -> Sequence:
        """The newest running sequence gives its blocks back."""
        return max(running, key=lambda s: (s.arrival_time, s.seq_id))

    def record_service(self, seq: Sequence, num_tokens: int) -> None:
        pass


class PriorityPolicy(FCFSPolicy):
    def select(self, waiting: Seq[Sequence]) -> Sequence:
        return min(waiting, key=lambda s: (s.priority, s.arrival_time, s.seq_id))

    def select_victim(self, running: Seq[Sequence]) -> Sequence:
        return max(running, key=lambda s: (s.priority, s.arrival_time, s.seq_id))


class FairPolicy(FCFSPolicy):
    """Weighted fair queuing over tenants: service is counted in computed tokens."""

    def __init__(self, weights: Mapping[str, float] | None = None):
        self.weights = dict(weights or {})
        self.service: defaultdict[str, float] = defaultdict(float)

    def _virtual_time(self, tenant: str) -> float:
        return self.service[tenant] / self.weights.get(tenant, 1.0)

    def select(self, waiting: Seq[Sequence]) -> Sequence:
        return min(waiting, key=lambda s: (self._virtual_time(s.tenant), s.arrival_time, s.seq_id))

    def select_victim(self, running: Seq[Sequence]) -> Sequence:
        return max(running, key=lambda s: (self._virtual_time(s.tenant), s.arrival_time, s.seq_id))

    def record_service(self, seq: Sequence, num_tokens: int) -> None:
        self.service[seq.tenant] += num_tokens


def make_policy(name: str) -> FCFSPolicy:
    policies = {"fcfs": FCFSPolicy, "priority": PriorityPolicy, "fair": FairPolicy}
    if name not in policies:
        raise ValueError(f"unknown scheduling policy {name!r} (choose from {', '.join(policies)})")
    return policies[name]()
