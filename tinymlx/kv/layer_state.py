"""One manager per kind of layer state, behind one interface the KV coordinator (coordinator.py) calls
for every kind alike; none of the coordinator's callers (the scheduler, the runner, the disk tier,
speculation) asks which kinds a model has.

    kind                 manager                                    holds
    full attention       GroupBlocks (group_blocks.py)              blocks of K/V for every token
    sliding window       SlidingWindowBlocks (group_blocks.py)      blocks of the last W tokens' K/V
    recurrent            RecurrentStates (recurrent_states.py)      a state slot per sequence, checkpoints
    KV-shared            SharedKVLayers (below)                     nothing: its layers read their source's

A manager that holds blocks (`cost` > 0: the KV groups) also keeps block tables through the coordinator
(group_blocks.py has those calls). The calls below are a sequence's life, and a manager that holds nothing
for it answers them as this base class does. A vision encoder's cache would be the next kind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from tinymlx.core.batch import StateAccess
from tinymlx.core.layer_specs import LayerSpec, SharedKV
from tinymlx.core.outputs import StateSlotStats
from tinymlx.core.sequence import Sequence as Seq
from tinymlx.kv.block_pool import BlockPool

BlockHashes = Sequence[tuple[int, tuple[int, ...]]]  # (chained hash, tokens) of a prompt's full blocks


class LayerStateManager:
    """The interface, and the answers of a kind that keeps nothing per sequence."""

    cost = 0  # pages of the shared pool one block of this kind takes (0: it holds no blocks)
    keeps_tails = True  # whether a freed sequence's partial last block can be resumed inside
    allows_run_ahead = True  # whether a step may be scheduled before the one in flight commits
    num_lower_restores = 0  # states (beyond blocks) it restored from the lower tier

    num_state_slots: int | None = None  # slots its state pool's arrays hold now (None: it keeps no slots)

    def join(self, pool: BlockPool) -> None:
        """It may keep what it holds in pages of the KV coordinator's pool (block_pool.py's region)."""

    def resume_query(self, hashes: BlockHashes) -> ResumeQuery:
        """Where a prompt with these full blocks may resume (a prefix hit): asked during one admission."""
        return ResumeQuery()

    def chunk_end(self, seq: Seq, end: int) -> int:
        """Where a chunk of `seq` from its computed tokens up to `end` may end (at most `end`)."""
        return end

    def admit(self, seq_id: int, hashes: BlockHashes, depth: int, num_hit_tokens: int) -> None:
        """`seq_id` starts running, resumed at block `depth` of `hashes` (`num_hit_tokens` served)."""

    def state_access(self, seq_id: int, start: int, end: int, num_prompt_tokens: int,
                     hashes: Sequence[int]) -> StateAccess | None:
        """What a chunk computing tokens start..end-1, scheduled now, reads and writes besides K/V;
        `hashes`: the sequence's published blocks' (after this chunk's are published)."""
        return None

    def with_snapshots(self, seq_id: int, access: StateAccess | None, num_drafts: int) -> StateAccess | None:
        """The access of a decode that verifies `num_drafts` drafts, keeping what rolling back needs."""
        return access

    def commit(self, seq_id: int, num_kept: int | None = None) -> None:
        """After the step that ran a chunk of `seq_id` (a verified one kept `num_kept` positions)."""

    def release(self, seq_id: int) -> None:
        """`seq_id` stops running (finished, aborted, preempted)."""

    def check(self, live_seq_ids: Iterable[int]) -> None:
        """Assert this manager's invariants; `live_seq_ids`: every sequence that may hold state."""

    def slot_stats(self) -> StateSlotStats | None:
        """Its per-sequence state slots, for stats() (None: it keeps none)."""
        return None


class ResumeQuery:
    """One admission's questions to one manager, as the coordinator looks for the deepest block every
    manager can resume after. `restorable(index)`: the lower tier may hold block `index` (which then
    counts as cached)."""

    def deepest(self, limit: int, restorable: Callable[[int], bool]) -> int:
        """An upper bound, at most `limit`, on the depth this manager can resume at."""
        return limit

    def can_resume(self, depth: int, restorable: Callable[[int], bool]) -> bool:
        """Whether a sequence can resume after `depth` full blocks here (`depth` within `deepest`)."""
        return True

    def fetch(self, depth: int) -> bool:
        """Read what resuming at `depth` needs from the lower tier, now (before the hit is counted); False
        when it cannot be had (the admission then tries shallower, where `can_resume` says no to `depth`)."""
        return True

    def apply(self) -> None:
        """The admission stands: install what `fetch` read, before the step's forward."""


class SharedKVLayers(LayerStateManager):
    """KV-shared layers (Gemma 3n/4): they attend over their source layer's K/V, through its group's pages
    and tables, and keep nothing of their own."""

    @classmethod
    def for_model(cls, specs: tuple[LayerSpec, ...]) -> tuple[SharedKVLayers, ...]:
        return (cls(),) if any(isinstance(spec, SharedKV) for spec in specs) else ()
