"""Accounting for the recurrent state slots (state_cache.py holds the states): live slots and checkpoints.

    slot 0                      ZERO_SLOT: the state of nothing, read by a sequence starting at token 0
    1 .. num_live+num_snapshots one live slot per running sequence: its state after its computed tokens;
                                and with speculative decoding, snapshots: a verified chunk [t, d1 .. dk]
                                writes the state after each of its first k positions to a snapshot slot
                                of its own, and at commit the state after the last kept token becomes the
                                live slot (its live slot holds the state after all k + 1: every draft kept)
                                while the others go back. Live and snapshot slots are one pool: a
                                rollback swaps ids, it copies no state.
    then .. num_slots-1         checkpoints: a state at a block end, keyed by the chained hash of the
                                block that ends there (the prefix cache's key), in the slots of a region
                                of the KV pool (kv/block_pool.py): it grows as checkpoints are kept, by
                                pages the KV groups leave free or cached, and gives its last slots back
                                when the groups need them. Region slot k is slot base + k.

A checkpoint slot is in exactly one state: free; reserved (a scheduled chunk writes it; published at
commit, once the forward has produced it); published (least recently used first, each stamped by the
pool's clock); evicted back to free when a reservation needs it (or the pool its pages) and no sequence
about to resume from it pins it. A checkpoint the disk tier restores is published at once (`install`),
for the sequence admitted with it: the tier writes its state before the step's forward, the first thing
to read it. Without a KV pool (`join`), the region is a pool of its own of `num_checkpoints` slots.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from tinymlx.kv.block_pool import BlockPool

ZERO_SLOT = 0


@dataclass
class _SeqState:
    """A running sequence's slots: its live slot, the slot its next chunk reads from, the checkpoints its
    scheduled chunk writes, as (block hash, slot), and its snapshots (the state after position i + 1 of a
    verified chunk in snapshots[i])."""

    slot: int
    source: int
    pending: list[tuple[int, int]] = field(default_factory=list)
    snapshots: list[int] = field(default_factory=list)


class StateSlots:
    def __init__(self, num_live: int, num_checkpoints: int, num_snapshots: int = 0):
        """`num_snapshots`: for speculative decoding, max_num_seqs times its most drafts per chunk;
        `num_checkpoints`: the most checkpoints kept at once."""
        self.num_live, self.num_snapshots = num_live, num_snapshots
        self.base = 1 + num_live + num_snapshots  # the first checkpoint slot
        self._free_live: deque[int] = deque(range(1, self.base))  # live and snapshot slots
        self._checkpoints: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, least recently used first
        self._stamps: dict[int, int] = {}  # block hash -> the pool's clock when it was last published or read
        self._hash_in: dict[int, int] = {}  # slot -> the block hash it holds
        self._free_region: set[int] = set()  # checkpoint slots of the region holding nothing
        self._reserved: set[int] = set()
        self._pins: Counter[int] = Counter()  # checkpoint slot -> sequences resuming from it this step
        self._of: dict[int, _SeqState] = {}  # seq id -> its slots, written here only
        self.num_resumed = 0  # sequences that resumed from a checkpoint
        self.num_resumed_tokens = 0  # tokens they did not recompute
        self.pool = BlockPool(num_checkpoints)
        self.pool.open_region(self, 1, num_checkpoints)

    def join(self, pool: BlockPool, slot_cost: int, num_initial: int = 0) -> None:
        """Keep the checkpoints (at most `num_checkpoints`) in `pool`'s region, `slot_cost` pages each (before
        any is kept), the region holding `num_initial` slots from the start (the pool's pages are free)."""
        assert not self.pool.region_slots, "checkpoints are kept already"
        most = self.num_checkpoints
        self.pool = pool
        pool.open_region(self, slot_cost, most)
        if num_initial:
            self._free_region.update(range(self.base, self.base + pool.extend_region(num_initial)))

    @property
    def num_checkpoints(self) -> int:
        """The most checkpoints that can be kept at once."""
        return self.pool.max_region_slots

    @property
    def num_slots(self) -> int:
        """Slots the states' arrays hold now: the zero state, the live and snapshot slots, the region."""
        return self.base + self.pool.region_slots

    @property
    def num_live_used(self) -> int:
        return self.num_live + self.num_snapshots - len(self._free_live)

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
            self._publish(resume_hash, state.source)  # read now: the most recently used
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

    def snapshot(self, seq_id: int, num_drafts: int) -> list[int]:
        """Slots for the states after each of the first `num_drafts` positions of the sequence's verified
        chunk (the one after its last position goes to the live slot)."""
        state = self._of[seq_id]
        assert not state.snapshots and len(self._free_live) >= num_drafts, "more drafts than snapshot slots"
        state.snapshots = [self._free_live.popleft() for _ in range(num_drafts)]
        return list(state.snapshots)

    def install(self, block_hash: int) -> int | None:
        """A published slot for the checkpoint of `block_hash` the lower tier restores (the caller admits a
        sequence resuming from it next, and has its state written before the step's forward); None when no
        slot can be freed."""
        assert block_hash not in self._checkpoints, "the checkpoint is in memory already"
        slot = self._take_checkpoint_slot()
        if slot is not None:
            self._publish(block_hash, slot)
        return slot

    def _take_checkpoint_slot(self) -> int | None:
        """A free slot of the region; else the older of growing the region (over the KV pool's free or cached
        pages) and evicting the least recently used unpinned checkpoint; None when neither can be had."""
        if not self._free_region:
            victim = next((h for h, s in self._checkpoints.items() if not self._pins[s]), None)
            growth = self.pool.extension_stamp()
            if growth is not None and (victim is None or growth < self._stamps[victim]):
                first = self.num_slots
                # Where pages are free, by as many as sequences may run at first, then by half: the states'
                # arrays grow by copying them whole.
                grown = self.pool.extend_region(max(self.num_live, self.pool.region_slots // 2))
                self._free_region.update(range(first, first + grown))
            elif victim is not None:
                self._free_region.add(self._forget(victim))
            else:
                return None
        slot = min(self._free_region)
        self._free_region.discard(slot)
        return slot

    def _publish(self, block_hash: int, slot: int) -> None:
        self._checkpoints[block_hash] = slot
        self._checkpoints.move_to_end(block_hash)
        self._stamps[block_hash], self._hash_in[slot] = self.pool.clock(), block_hash

    def _forget(self, block_hash: int) -> int:
        slot = self._checkpoints.pop(block_hash)
        del self._stamps[block_hash], self._hash_in[slot]
        return slot

    # -- the region's last slot, for the pool (block_pool.RegionMember) -------------------------
    def _is_releasable(self, slot: int) -> bool:
        return slot in self._free_region or (slot in self._hash_in and not self._pins[slot])

    def num_releasable_at_edge(self) -> int:
        slots = range(self.num_slots - 1, self.base - 1, -1)
        return next((i for i, slot in enumerate(slots) if not self._is_releasable(slot)), len(slots))

    def release_edge(self) -> None:
        slot = self.num_slots - 1
        if slot in self._hash_in:
            self._forget(self._hash_in[slot])
        self._free_region.discard(slot)

    def commit(self, seq_id: int, num_kept: int | None = None) -> None:
        """After the step that ran the sequence's chunk: its reserved checkpoints hold their states now, and
        its state is in its live slot: for a verified chunk that kept `num_kept` of its positions, the
        snapshot after them becomes it."""
        state = self._of[seq_id]
        for block_hash, slot in state.pending:
            self._reserved.discard(slot)
            if block_hash in self._checkpoints:  # another sequence published the same state this step
                self._free_region.add(slot)
            else:
                self._publish(block_hash, slot)
        state.pending = []
        self._unpin(state)
        if num_kept is not None and num_kept <= len(state.snapshots):
            state.slot, state.snapshots[num_kept - 1] = state.snapshots[num_kept - 1], state.slot
        self._free_live.extend(state.snapshots)
        state.snapshots = []
        state.source = state.slot

    def free(self, seq_id: int) -> None:
        """The sequence stops running (finished, aborted, preempted): its live state is dropped."""
        state = self._of.pop(seq_id, None)
        if state is None:
            return
        for _, slot in state.pending:
            self._reserved.discard(slot)
            self._free_region.add(slot)
        self._unpin(state)
        self._free_live.extend([state.slot, *state.snapshots])

    def _unpin(self, state: _SeqState) -> None:
        if state.source not in (ZERO_SLOT, state.slot):
            self._pins[state.source] -= 1
            if not self._pins[state.source]:
                del self._pins[state.source]

    # -- integrity ----------------------------------------------------------------------------
    def check(self, live_seq_ids: Iterable[int]) -> None:
        assert set(self._of) <= set(live_seq_ids), "a state slot leaked: its sequence is no longer live"
        live = list(self._of.values())
        slots = [slot for s in live for slot in (s.slot, *s.snapshots)]
        assert len(set(slots)) == len(slots), "two sequences share a live or snapshot state slot"
        assert set(slots).isdisjoint(self._free_live) and len(set(self._free_live)) == len(self._free_live)
        assert len(slots) + len(self._free_live) == self.num_live + self.num_snapshots, "a live state slot leaked"
        assert len(live) <= self.num_live, "more running sequences than live state slots"
        pending = [slot for s in live for _, slot in s.pending]
        assert set(pending) == self._reserved, "reserved checkpoints differ from the sequences' pending ones"
        published = set(self._checkpoints.values())
        assert {slot: h for h, slot in self._checkpoints.items()} == self._hash_in and set(self._stamps) == set(self._checkpoints)
        parts = [published, self._reserved, self._free_region]
        region = set(range(self.base, self.num_slots))
        assert sum(map(len, parts)) == len(region) and set().union(*parts) == region, "a checkpoint slot leaked"
        stamps = [self._stamps[h] for h in self._checkpoints]
        assert stamps == sorted(stamps), "checkpoints out of their release order"
        pins = Counter(s.source for s in live if s.source not in (ZERO_SLOT, s.slot))
        assert pins == self._pins and set(pins) <= published, "pins differ from the sequences resuming"
