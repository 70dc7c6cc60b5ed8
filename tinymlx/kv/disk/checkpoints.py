"""DiskCheckpoints: a hybrid model's recurrent-state checkpoints in the disk tier, beside the KV blocks.

    a checkpoint a chunk's forward wrote (a state slot, at a prompt block's end)
      -> save (engine thread, after the forward: one gather per pool, host copies)
      -> BlockWriter -> DiskStore, as the KV blocks go
    a prefix hit whose deepest checkpoint is only on disk (BlockManager.allocate)
      -> fetch: read and verify now (a bad file is deleted, with a warning; the hit moves back)
      -> restore: staged -> apply_restores, before the step's forward: write_slot into the installed slot

A checkpoint is a sibling file of its block's, not part of it: the state exists only at some block ends
(chunk ends, every checkpoint_interval blocks, a prompt's last full block) and may be made long after
the block's K/V were saved (another prompt's chunk ending there), it is far larger (Qwen3.5-0.8B: 20 MB
against a 16-token block's 0.2-0.4 MB), and a hit reads every block of its chain but only the state where it
stops. Its file is a block file (block_file.py: checksummed, its header naming the key, the chain hash,
the block's tokens, the model's fingerprint and the state's layout), in the same store under the same
bound, named by the digest of the fingerprint, "state" and the block's chain hash.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np

from tinymlx.core.layer_specs import Recurrent
from tinymlx.kv.disk.block_file import BlockHeader
from tinymlx.kv.disk.block_writer import BlockWrite, BlockWriter
from tinymlx.kv.disk.fingerprint import state_layout_text
from tinymlx.kv.disk.store import DiskStore
from tinymlx.kv.state_cache import RecurrentStateCache

ReadFile = Callable[[BlockHeader], list[np.ndarray] | None]  # DiskTier._read: verified arrays, or None
FileKey = Callable[[str, int], str]  # (fingerprint, chain hash) -> file name (tier.file_key)


class DiskCheckpoints:
    """`layers`: the recurrent layers, in the state cache's order; `read`: the tier's verified read."""

    def __init__(self, store: DiskStore, writer: BlockWriter, states: RecurrentStateCache,
                 layers: tuple[tuple[int, Recurrent], ...], fingerprint: str, file_key: FileKey, read: ReadFile):
        self.store, self.writer, self.states, self.fingerprint = store, writer, states, fingerprint
        self.layout = state_layout_text(layers)
        self._key_of, self._read = file_key, read
        self._specs = tuple(spec for _, s in layers for spec in (((s.kernel - 1, s.conv_dim), "float32"),
                                                                  ((s.heads, s.key_dim, s.value_dim), "float32")))
        self.nbytes = sum(math.prod(shape) * 4 for shape, _ in self._specs)
        self._restores: list[tuple[int, list[np.ndarray]]] = []
        self.num_writes_dropped = 0

    def key(self, block_hash: int) -> str:
        return self._key_of(f"{self.fingerprint}:state", block_hash)

    def holds(self, block_hash: int) -> bool:
        return self.key(block_hash) in self.store

    def fetch(self, block_hash: int, tokens: tuple[int, ...]) -> list[np.ndarray] | None:
        return self._read(self._header(block_hash, tokens))

    def restore(self, slot: int, data: list[np.ndarray]) -> None:
        self._restores.append((slot, data))

    def apply_restores(self) -> None:
        """Write the states fetched this step into their slots (before the forward reads them)."""
        restores, self._restores = self._restores, []
        for slot, data in restores:
            self.states.write_slot(slot, data)

    def uses(self, block_hashes: Iterable[tuple[int, int]]) -> list[tuple[str, int]]:
        """(key, recency) of the files among these (chain hash, recency) that the store holds: used again."""
        return [(key, used_at) for block_hash, used_at in block_hashes if (key := self.key(block_hash)) in self.store]

    def save(self, entries: Iterable[tuple[int, tuple[int, ...], int, int]]) -> None:
        """Queue host copies of these checkpoints (chain hash, block tokens, slot, recency) that the disk does
        not hold yet, the least recent first (a chain's deepest): when the writer's queue is short, a prompt's
        last checkpoint, the one its next turn resumes from, is the last dropped."""
        entries = sorted((e for e in entries if self.key(e[0]) not in self.store
                          and self.key(e[0]) not in self.writer.pending_keys), key=lambda e: e[3])
        room = self.writer.room(self.nbytes)
        self.num_writes_dropped += max(0, len(entries) - room)
        entries = entries[:room]
        if not entries:
            return
        for (block_hash, tokens, _, used_at), arrays in zip(entries, self.states.read_slots([e[2] for e in entries])):
            if not self.writer.put(BlockWrite(self._header(block_hash, tokens), arrays, self.nbytes, used_at)):
                self.num_writes_dropped += 1

    def _header(self, block_hash: int, tokens: tuple[int, ...]) -> BlockHeader:
        return BlockHeader(self.key(block_hash), block_hash, tokens, self.fingerprint, self.layout, self._specs)
