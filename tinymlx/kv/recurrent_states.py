"""The recurrent kind's manager (kv/layer_state.py): a state slot per running sequence, and checkpoints of the
state at block ends for prefix hits (the slots' accounting: state_slots.py; the states: state_cache.py).

A recurrent state exists only where a chunk stops or a checkpoint is kept, so:
- a prefill chunk ends at a block end (or at the prompt's last token), and a prefix hit resumes only
  after a block whose checkpoint is in memory, or in the lower tier (the disk), which restores it into
  a fresh checkpoint slot before the step's forward;
- a freed sequence's partial last block is not resumable inside (no tails): its decodes leave a
  checkpoint at every block end of the reply instead, so a conversation's next turn recomputes at most
  block_size - 1 of its tokens and its own;
- a step is not scheduled before the one in flight commits: commit publishes its checkpoints.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from tinymlx.core.batch import StateAccess
from tinymlx.core.config import EngineConfig
from tinymlx.core.layer_specs import LayerSpec, Recurrent, recurrent_layers, state_bytes_per_slot
from tinymlx.core.outputs import StateSlotStats
from tinymlx.core.sequence import Sequence as Seq
from tinymlx.kv.block_pool import BlockPool
from tinymlx.kv.layer_state import BlockHashes, LayerStateManager, ResumeQuery
from tinymlx.kv.state_slots import StateSlots


class CheckpointTier(Protocol):
    """Where checkpoints the slots no longer hold may still be (the disk tier: coordinator.LowerTier)."""

    def holds_checkpoint(self, block_hash: int) -> bool: ...
    def fetch_checkpoint(self, block_hash: int, tokens: tuple[int, ...]) -> object | None: ...
    def restore_checkpoint(self, slot: int, data: object) -> None: ...


class RecurrentStates(LayerStateManager):
    """`layers`: the recurrent layers' (layer, spec); `slots`: their slots' accounting; a prompt's chunks keep
    a checkpoint every `checkpoint_interval` blocks (a hit is then never far short of a shared prefix's end).
    `slot_pages`: the pages of the KV pool a checkpoint takes once it `join`s one (0: the slots keep a region
    of their own), `num_initial_checkpoints` slots of them from the start."""

    keeps_tails = False
    allows_run_ahead = False

    def __init__(self, layers: tuple[tuple[int, Recurrent], ...], slots: StateSlots, block_size: int,
                 enable_prefix_caching: bool = True, checkpoint_interval: int = 16,
                 lower_tier: CheckpointTier | None = None, slot_pages: int = 0, num_initial_checkpoints: int = 0):
        self.layers, self.slots, self.block_size = layers, slots, block_size
        self.enable_prefix_caching, self.checkpoint_interval = enable_prefix_caching, checkpoint_interval
        self.lower_tier = lower_tier
        self.slot_pages, self.num_initial_checkpoints = slot_pages, num_initial_checkpoints
        self.num_lower_restores = 0  # checkpoints restored from the lower tier

    @classmethod
    def for_model(cls, specs: tuple[LayerSpec, ...], config: EngineConfig,
                  lower_tier: CheckpointTier | None = None) -> tuple[RecurrentStates, ...]:
        """The manager of a model's recurrent layers, sized by the config: none without any."""
        layers = recurrent_layers(specs)
        if not layers:
            return ()
        slots = StateSlots(config.max_num_seqs, config.num_state_checkpoints, config.num_state_snapshots)
        return (cls(layers, slots, config.block_size, config.enable_prefix_caching, lower_tier=lower_tier,
                    slot_pages=config.state_slot_pages, num_initial_checkpoints=config.num_initial_checkpoints),)

    def join(self, pool: BlockPool) -> None:
        """Keep the checkpoints in pages of the KV pool, where the config priced them."""
        if self.slot_pages:
            self.slots.join(pool, self.slot_pages, self.num_initial_checkpoints)

    @property
    def num_state_slots(self) -> int:
        return self.slots.num_slots

    def chunk_end(self, seq: Seq, end: int) -> int:
        if end >= seq.num_tokens:
            return end
        return max(seq.num_computed_tokens, end // self.block_size * self.block_size)

    def resume_query(self, hashes: BlockHashes) -> ResumeQuery:
        return _CheckpointQuery(self, hashes)

    def admit(self, seq_id: int, hashes: BlockHashes, depth: int, num_hit_tokens: int) -> None:
        self.slots.admit(seq_id, hashes[depth - 1][0] if depth else None, num_hit_tokens)

    def state_access(self, seq_id: int, start: int, end: int, num_prompt_tokens: int,
                     hashes: Sequence[int]) -> StateAccess:
        """It reads its source slot and writes its live slot, plus a checkpoint at each block end it keeps:
        the chunk's end (so a decode leaves one at every block end of the reply, where a conversation's next
        turn resumes), the prompt's last full block, and every `checkpoint_interval` blocks."""
        bs, checkpoints = self.block_size, []
        last_full = num_prompt_tokens // bs
        for block in range(start // bs + 1, end // bs + 1):
            is_kept = block * bs == end or block == last_full or block % self.checkpoint_interval == 0
            if is_kept and self.enable_prefix_caching and block <= len(hashes):
                slot = self.slots.reserve(seq_id, hashes[block - 1])
                if slot is not None:
                    checkpoints.append((block * bs - start, slot))
        return StateAccess(*self.slots.slots(seq_id), tuple(checkpoints))

    def with_snapshots(self, seq_id: int, access: StateAccess | None, num_drafts: int) -> StateAccess | None:
        """The states after each of its first `num_drafts` positions are kept too, in snapshot slots
        (state_slots.py), so that any number of them can be kept at commit."""
        if not num_drafts:
            return access
        snapshots = self.slots.snapshot(seq_id, num_drafts)
        return access._replace(checkpoints=access.checkpoints + tuple(enumerate(snapshots, start=1)))

    def commit(self, seq_id: int, num_kept: int | None = None) -> None:
        self.slots.commit(seq_id, num_kept)

    def release(self, seq_id: int) -> None:
        self.slots.free(seq_id)

    def check(self, live_seq_ids: Iterable[int]) -> None:
        self.slots.check(live_seq_ids)

    def slot_stats(self) -> StateSlotStats:
        slots, slot_nbytes = self.slots, state_bytes_per_slot(tuple(spec for _, spec in self.layers))
        return StateSlotStats(
            num_layers=len(self.layers), num_live_slots=slots.num_live, num_live_used=slots.num_live_used,
            num_checkpoint_slots=slots.num_checkpoints, num_checkpoints_cached=slots.num_cached_checkpoints,
            num_resumed=slots.num_resumed, num_resumed_tokens=slots.num_resumed_tokens,
            nbytes=slots.num_slots * slot_nbytes, slot_nbytes=slot_nbytes, num_fixed_slots=slots.base)


class _CheckpointQuery(ResumeQuery):
    """A sequence resumes after a block whose checkpoint is in a slot, or in the lower tier (asked once per
    block); one the lower tier fails to give, or that finds no slot, is not offered again."""

    def __init__(self, states: RecurrentStates, hashes: BlockHashes):
        self.states, self.hashes = states, hashes
        lower = states.lower_tier if states.slots.num_checkpoints else None  # a restore needs a slot to go to
        self._on_lower: Callable[[int], bool] = functools.cache(
            lambda index: lower is not None and lower.holds_checkpoint(hashes[index][0]))
        self._gone: set[int] = set()
        self._restore: tuple[int, object] | None = None

    def can_resume(self, depth: int, restorable: Callable[[int], bool]) -> bool:
        if depth == 0:
            return True
        index = depth - 1
        return index not in self._gone and (self.states.slots.has_checkpoint(self.hashes[index][0]) or self._on_lower(index))

    def fetch(self, depth: int) -> bool:
        self._restore = None
        if depth == 0 or self.states.slots.has_checkpoint(self.hashes[depth - 1][0]):
            return True
        # Not in a slot: on the lower tier, or evicted since `can_resume` (admitting this sequence took its page).
        block_hash, tokens = self.hashes[depth - 1]
        lower = self.states.lower_tier
        data = None if lower is None else lower.fetch_checkpoint(block_hash, tokens)
        slot = None if data is None else self.states.slots.install(block_hash)
        if slot is None:
            self._gone.add(depth - 1)
            return False
        self._restore = (slot, data)
        return True

    def apply(self) -> None:
        if self._restore is not None:
            self.states.lower_tier.restore_checkpoint(*self._restore)
            self.states.num_lower_restores += 1
