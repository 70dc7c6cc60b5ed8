"""Accounting for the recurrent state slots (state_cache.py holds the states): live slots and checkpoints.

    slot 0                      ZERO_SLOT: the state of nothing, read by a sequence starting at token 0
    1 .. num_live               one live slot per running sequence: its state after its computed tokens
    num_live+1 .. num_slots-1   checkpoints: a state at a block end, keyed by the chained hash of the
                                block that ends there (the prefix cache's key), least recently used first

A checkpoint slot is in exactly one state: free; reserved (a scheduled chunk writes it; published at
commit, once the forward has produced it); published (in the LRU); evicted back to free when a
reservation needs it and no sequence about to resume from it pins it. A checkpoint the disk tier
restores is published at once (`install`), for the sequence admitted with it: the tier writes its state
before the step's forward, the first thing to read it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

ZERO_SLOT = 0


@dataclass
class _SeqState:
    """A running sequence's slots: its live slot, the slot its next chunk reads from, and the checkpoints its
    scheduled chunk writes, as (block hash, slot)."""

    slot: int
    source: int
    pending: list[tuple[int, int]] = field(default_factory=list)


class StateSlots:
    def __init__(self, num_live: int, num_checkpoints: int):
        self.num_live, self.num_checkpoints = num_live, num_checkpoints
        self._free_live: deque[int] = deque(range(1, 1 + num_live))
        self._free_checkpoints: deque[int] = deque(range(1 + num_live, self.num_slots))
        self._checkpoints: OrderedDict[int, int] = OrderedDict()  # block hash -> slot
        self._reserved: set[int] = set()
        self._pins: Counter[int] = Counter()  # checkpoint slot -> sequences resuming from it this step
        self._of: dict[int, _SeqState] = {}  # seq id -> its slots, written here only
        self.num_resumed = 0  # sequences that resumed from a checkpoint
        self.num_resumed_tokens = 0  # tokens they did not recompute

    @property
    def num_slots(self) -> int:
        return 1 + self.num_live + self.num_checkpoints

    @property
    def num_live_used(self) -> int:
        return self.num_live - len(self._free_live)

    @property
    def num_cached_checkpoints(self) -> int:
        return len(self._checkpoints)

    def has_checkpoint(self, block_hash: int) -> bool:
        return block_hash in self._checkpoints

    # -- a sequence's life ---------------------------------------------------------------------
    def slots(self, seq_id: int) -> tuple[int, int]:
        """(the slot the sequence's next chunk reads from, its live slot)."""
        state = self._of[seq_id]
        return state.source, state.slot

    def admit(self, seq_id: int, resume_hash: int | None, num_tokens: int) -> None:
        """A live slot for the sequence, whose first chunk reads the checkpoint of `resume_hash` (None: zero)."""
        assert self._free_live, "more running sequences than live state slots"
        state = self._of[seq_id] = _SeqState(self._free_live.popleft(), ZERO_SLOT)
        if resume_hash is not None:
            state.source = self._checkpoints[resume_hash]
            self._checkpoints.move_to_end(resume_hash)
            self._pins[state.source] += 1
            self.num_resumed += 1
            self.num_resumed_tokens += num_tokens

    def reserve(self, seq_id: int, block_hash: int) -> int | None:
        """A slot for the state at the end of the block `block_hash` names, written by the chunk being
        scheduled; None when there is one already, or none can be freed."""
        state = self._of[seq_id]
        if block_hash in self._checkpoints or any(h == block_hash for h, _ in state.pending):
            return None
        slot = self._take_checkpoint_slot()
        if slot is not None:
            self._reserved.add(slot)
            state.pending.append((block_hash, slot))
        return slot

    def install(self, block_hash: int) -> int | None:
        """A published slot for the checkpoint of `block_hash` the lower tier restores (the caller admits a
        sequence resuming from it next, and has its state written before the step's forward); None when no
        slot can be freed."""
        assert block_hash not in self._checkpoints, "the checkpoint is in memory already"
        slot = self._take_checkpoint_slot()
        if slot is not None:
            self._checkpoints[block_hash] = slot
        return slot

    def _take_checkpoint_slot(self) -> int | None:
        """A free checkpoint slot, else the least recently used unpinned one's; None when all are pinned."""
        if self._free_checkpoints:
            return self._free_checkpoints.popleft()
        victim = next((h for h, s in self._checkpoints.items() if not self._pins[s]), None)
        return None if victim is None else self._checkpoints.pop(victim)

    def commit(self, seq_id: int) -> None:
        """After the step that ran the sequence's chunk: its reserved checkpoints hold their states now, and
        its state is in its live slot."""
        state = self._of[seq_id]
        for block_hash, slot in state.pending:
            self._reserved.discard(slot)
            if block_hash in self._checkpoints:  # another sequence published the same state this step
                self._free_checkpoints.append(slot)
            else:
                self._checkpoints[block_hash] = slot
        state.pending = []
        self._unpin(state)
        state.source = state.slot

    def free(self, seq_id: int) -> None:
        """The sequence stops running (finished, aborted, preempted): its live state is dropped."""
        state = self._of.pop(seq_id, None)
        if state is None:
            return
        for _, slot in state.pending:
            self._reserved.discard(slot)
            self._free_checkpoints.append(slot)
        self._unpin(state)
        self._free_live.append(state.slot)

    def _unpin(self, state: _SeqState) -> None:
        if state.source not in (ZERO_SLOT, state.slot):
            self._pins[state.source] -= 1
            if not self._pins[state.source]:
                del self._pins[state.source]

    # -- integrity ----------------------------------------------------------------------------
    def check(self, live_seq_ids: Iterable[int]) -> None:
        assert set(self._of) <= set(live_seq_ids), "a state slot leaked: its sequence is no longer live"
        live = list(self._of.values())
        slots = [s.slot for s in live]
        assert len(set(slots)) == len(slots), "two sequences share a live state slot"
        assert set(slots).isdisjoint(self._free_live) and len(set(self._free_live)) == len(self._free_live)
        assert len(slots) + len(self._free_live) == self.num_live, "a live state slot leaked"
        pending = [slot for s in live for _, slot in s.pending]
        assert set(pending) == self._reserved, "reserved checkpoints differ from the sequences' pending ones"
        published = set(self._checkpoints.values())
        parts = [published, self._reserved, set(self._free_checkpoints)]
        assert sum(map(len, parts)) == self.num_checkpoints == len(set().union(*parts)), "a checkpoint slot leaked"
        pins = Counter(s.source for s in live if s.source not in (ZERO_SLOT, s.slot))
        assert pins == self._pins and set(pins) <= published, "pins differ from the sequences resuming"
