"""Admission control: refuse at once (503 + Retry-After) instead of queueing without bound.

A request is refused when
  - queue_full: its choices would take the queue past `max_queue` (the queue: admitted choices that
    have not produced their first token yet, so waiting or still in prefill), or
  - kv_full: its prompts need more KV pool pages than are free or evictable now, after the pages the
    queued choices' prompts will take.
Both are decided from counts kept here, updated as choices start and finish, plus the engine's
latest stats for the pool, so concurrent admissions never oversubscribe.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tinymlx.core.outputs import EngineStats
from tinymlx.turns.api_error import APIError


@dataclass(frozen=True)
class Ticket:
    """One admitted choice's share of the queue and of the reserved pages."""

    num_blocks: int  # pages of the pool


class Admission:
    """`blocks_for(num_tokens)`: the KV pool pages a sequence of that many tokens holds (Engine.kv_blocks_for)."""

    def __init__(self, max_queue: int, blocks_for: Callable[[int], int], retry_after_s: int = 1):
        self.max_queue, self.blocks_for, self.retry_after_s = max_queue, blocks_for, retry_after_s
        self.num_queued = 0
        self.num_reserved_blocks = 0

    def admit(self, prompt_lengths: list[int], n: int, stats: EngineStats) -> list[Ticket]:
        """Tickets for n choices of each prompt, or APIError(503) with the reason."""
        num_choices = len(prompt_lengths) * n
        if self.num_queued + num_choices > self.max_queue:
            self._refuse("queue_full", f"the queue is full ({self.num_queued} waiting, limit {self.max_queue})")
        # A prompt's full blocks are shared by its n choices through the prefix cache; each choice
        # needs a block of its own for the partial last block and the first generated token.
        tickets = []
        for length in prompt_lengths:
            tickets += [Ticket(self.blocks_for(length + 1))] + [Ticket(self.blocks_for(1))] * (n - 1)
        needed = sum(t.num_blocks for t in tickets)
        available = stats.num_pages_available - self.num_reserved_blocks
        if needed > available:
            self._refuse("kv_full", f"the KV cache cannot hold this prompt now ({needed} pages needed, "
                                    f"{max(available, 0)} available)")
        self.num_queued += num_choices
        self.num_reserved_blocks += needed
        return tickets

    def started(self, ticket: Ticket) -> None:
        """The choice produced its first token (or ended): it leaves the queue; its pages are the engine's."""
        self.num_queued -= 1
        self.num_reserved_blocks -= ticket.num_blocks

    def _refuse(self, reason: str, message: str) -> None:
        raise APIError(503, f"{message}; retry after {self.retry_after_s} s", code=reason,
                       error_type="server_overloaded", headers={"Retry-After": str(self.retry_after_s)})
