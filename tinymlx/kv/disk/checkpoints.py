"""DiskCheckpoints: one state pool's checkpoints in the disk tier, beside the KV blocks (a hybrid model's
recurrent states; kv/state_pool.py).

    a checkpoint a chunk's forward wrote (a state slot, at a prompt block's end)
      -> save (engine thread, after the forward: one gather per pool, host copies)
      -> BlockWriter -> DiskStore, as the KV blocks go
    a prefix hit whose deepest checkpoint is only on disk (KVCoordinator.allocate)
      -> fetch: read and verify now (a bad file is deleted, with a warning; the hit moves back)
      -> restore: staged -> take_restores: the runner's step writes it into the installed slot before its forward

A checkpoint is a sibling file of its block's, not part of it: the state exists only at some block ends
(chunk ends, every checkpoint_interval blocks, a prompt's last full block) and may be made long after
the block's K/V were saved (another prompt's chunk ending there), it is far larger (Qwen3.5-0.8B: 20 MB
against a 16-token block's 0.2-0.4 MB), and a hit reads every block of its chain but only the state where it
stops. Its file is a block file (block_file.py: checksummed, its header naming the key, the chain hash,
the block's tokens, the model's fingerprint and the state's layout), in the same store under the same
bound, named by the digest of the fingerprint, the pool's `disk_name` and the block's chain hash.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import NamedTuple

import numpy as np

from tinymlx.core.batch import ScheduledChunk
from tinymlx.core.sequence import Sequence
from tinymlx.kv.disk.block_file import BlockHeader
from tinymlx.kv.disk.block_writer import BlockWrite, BlockWriter
from tinymlx.kv.disk.store import DiskStore
from tinymlx.kv.state_pool import StatePool

ReadFile = Callable[[BlockHeader], list[np.ndarray] | None]  # DiskTier._read: verified arrays, or None
FileKey = Callable[[str, int], str]  # (fingerprint, chain hash) -> file name (tier.file_key)
Save = tuple[int, tuple[int, ...], int, int]  # (chain hash, block tokens, slot, recency)


class PromptChunk(NamedTuple):
    """A chunk whose forward computed prompt blocks, as the disk tier saves them after it."""

    seq: Sequence
    chunk: ScheduledChunk
    block_hashes: list[int]  # the chained hashes of the sequence's published blocks
    end: int  # where the chunk's prompt tokens end
    used_at: int  # its blocks' recency: the sequence's arrival (ns), less each block's depth


class DiskCheckpoints:
    """`pool`: the state pool whose slots it saves and restores; `read`: the tier's verified read."""

    def __init__(self, store: DiskStore, writer: BlockWriter, pool: StatePool, block_size: int, fingerprint: str,
                 file_key: FileKey, read: ReadFile):
        self.store, self.writer, self.pool, self.block_size = store, writer, pool, block_size
        self.fingerprint, self.layout, self._specs = fingerprint, pool.layout, pool.slot_arrays
        self._key_of, self._read = file_key, read
        self.nbytes = sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in self._specs)
        self._restores: list[tuple[int, list[np.ndarray]]] = []
        self.num_writes_dropped = 0

    def key(self, block_hash: int) -> str:
        return self._key_of(f"{self.fingerprint}:{self.pool.disk_name}", block_hash)

    def holds(self, block_hash: int) -> bool:
        return self.key(block_hash) in self.store

    def fetch(self, block_hash: int, tokens: tuple[int, ...]) -> list[np.ndarray] | None:
        return self._read(self._header(block_hash, tokens))

    def restore(self, slot: int, data: list[np.ndarray]) -> None:
        self._restores.append((slot, data))

    def take_restores(self) -> list[tuple[int, list[np.ndarray]]]:
        """(slot, state) of the states fetched this step, for the step to write before its forward reads them."""
        restores, self._restores = self._restores, []
        return restores

    def after_forward(self, chunks: list[PromptChunk]) -> tuple[list[tuple[str, int]], list[Save]]:
        """What these chunks' forward leaves: (key, recency) of the files the store holds at their prompt
        blocks' ends, used again; and the checkpoints the chunks wrote, each as recent as its block (`save`)."""
        bs, uses, saves = self.block_size, [], []
        for seq, chunk, block_hashes, end, used_at in chunks:
            for offset, slot in chunk.state.checkpoints:
                index = (chunk.start_position + offset) // bs - 1  # the block it ends
                saves.append((block_hashes[index], seq.block_keys(index * bs, (index + 1) * bs), slot, used_at - index))
            uses += [(key, used_at - i) for i in range(end // bs) if (key := self.key(block_hashes[i])) in self.store]
        return uses, saves

    def save(self, entries: Iterable[Save]) -> None:
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
        for (block_hash, tokens, _, used_at), arrays in zip(entries, self.pool.read_slots([e[2] for e in entries])):
            if not self.writer.put(BlockWrite(self._header(block_hash, tokens), arrays, self.nbytes, used_at)):
                self.num_writes_dropped += 1

    def _header(self, block_hash: int, tokens: tuple[int, ...]) -> BlockHeader:
        return BlockHeader(self.key(block_hash), block_hash, tokens, self.fingerprint, self.layout, self._specs)
