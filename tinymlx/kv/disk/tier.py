"""DiskTier: the prefix cache's disk tier, between the KV coordinator's decisions and the pool's arrays.

    a block evicted from memory, or a prompt's full blocks once computed
      -> read_blocks (engine thread, between steps: one small gather per layer piece, host copies; no
         reference to a pool array is kept, which would make the next scatter copy the whole pool)
      -> BlockWriter (writer thread: encode, temporary file, os.replace) -> DiskStore (bound, LRU)
    a prefix hit going on past memory (KVCoordinator.allocate)
      -> fetch: read and verify now (a bad file is deleted, with a warning, and its block recomputed)
      -> restore: staged -> before_forward: the writes the runner's step makes into the new blocks

A file holds one full block of every attention layer (of each piece of it, where layers differ in K/V
shape). Its key is the digest of the model's fingerprint (fingerprint.py) and the block's chain hash
(prefix_cache.chain_hash): two models never share a name, and a restarted process finds its blocks
again. The state pools' checkpoints (a hybrid model's recurrent states) go in sibling files, through the
same verified read, writer, store and staged restore (checkpoints.py).
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
import weakref
from collections.abc import Callable, Iterable
from functools import lru_cache

import mlx.core as mx
import numpy as np

from tinymlx.core.batch import ScheduledBatch, ScheduledChunk
from tinymlx.core.config import EngineConfig
from tinymlx.core.layer_specs import page_groups
from tinymlx.core.outputs import DiskCacheStats
from tinymlx.core.sequence import Sequence
from tinymlx.kv.coordinator import KVCoordinator
from tinymlx.kv.disk import block_file
from tinymlx.kv.disk.block_file import BlockHeader
from tinymlx.kv.disk.block_writer import BlockTouch, BlockWrite, BlockWriter
from tinymlx.kv.disk.checkpoints import DiskCheckpoints, PromptChunk
from tinymlx.kv.disk.fingerprint import layout_text, model_fingerprint
from tinymlx.kv.disk.store import DiskStore
from tinymlx.kv.group_blocks import NULL_BLOCK
from tinymlx.kv.kv_cache import PagedKVCache
from tinymlx.kv.pool_writes import PageWrite, PoolWrite, SlotWrite
from tinymlx.kv.state_pool import StatePool
from tinymlx.models import CausalLM

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_BYTES = 256 << 20  # host copies waiting for the writer; past it, writes are dropped
CachedPage = Callable[[int, int, tuple[int, ...]], int | None]  # (page group, hash, tokens) -> page


@lru_cache(maxsize=1 << 16)
def file_key(fingerprint: str, block_hash: int) -> str:
    text = f"{block_file.FORMAT_VERSION}:{fingerprint}:{block_hash:032x}"
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _host_dtype(dtype: mx.Dtype) -> str:
    """The NumPy dtype read_blocks returns for a pool of `dtype` (bfloat16 comes as its uint16 bits)."""
    return "uint16" if dtype == mx.bfloat16 else str(dtype).rsplit(".", 1)[-1]


class DiskTier:
    """`page_groups`: each page group's run of (layer, piece) pairs (core/layer_specs.page_groups), in the
    order of the KV coordinator's page tables; `state_pools`: the runner's (kv/state_pool.py), whose slots'
    checkpoints it keeps, each pool's in files of their own. A file holds each piece's arrays in (layer, piece)
    order: a model of one piece per layer writes them layer by layer, as files always have."""

    def __init__(self, store: DiskStore, cache: PagedKVCache, num_kv_heads: int, fingerprint: str, layout: str,
                 page_groups: tuple[tuple[tuple[int, int], ...], ...],
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES, state_pools: tuple[StatePool, ...] = ()):
        self.store, self.cache, self.fingerprint, self.layout = store, cache, fingerprint, layout
        self.is_enabled = True
        self.block_size = cache.block_size
        # (place in its run's pool arrays, page group), in (layer, piece) order
        self._pieces = [(place, g) for *_, place, g in sorted(
            (layer, piece, place, g) for g, run in enumerate(page_groups) for place, (layer, piece) in enumerate(run))]
        self._num_groups = len(page_groups)
        per_layer = [((num_kv_heads, cache.block_size, width), _host_dtype(dtype))
                     for width, dtype in cache.layout.widths] * 2  # K's arrays, then V's
        self._arrays_per_layer = len(per_layer)
        self._specs = tuple(spec for _ in self._pieces for spec in per_layer)
        self.block_nbytes = sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in self._specs)
        self._evicted: dict[int, tuple[tuple[int, ...], dict[int, int]]] = {}  # hash -> (tokens, {page group: page})
        self._restores: list[tuple[tuple[int, ...], list[np.ndarray]]] = []
        self.writer = BlockWriter(store, max_pending_bytes)
        # An engine dropped or a process exiting without close(): its queued writes still finish (up to 10 s).
        weakref.finalize(self, self.writer.close)
        self.num_bytes_read = self.num_bad_files = self.num_writes_dropped = 0
        self.checkpoints = tuple(DiskCheckpoints(store, self.writer, pool, self.block_size, fingerprint, file_key,
                                                 self._read) for pool in state_pools)
        self._wall_at_start_ns, self._monotonic_at_start = time.time_ns(), time.monotonic()

    @classmethod
    def open(cls, config: EngineConfig, model: CausalLM, cache: PagedKVCache,
             state_pools: tuple[StatePool, ...] = ()) -> DiskTier:
        """The tier of `config.disk_cache_dir` for `model`, its pool and its state pools."""
        block_size, layout = config.block_size, cache.layout
        return cls(DiskStore(config.disk_cache_dir, config.disk_cache_bytes), cache, cache.num_kv_heads,
                   model_fingerprint(model, layout, block_size, tuple(pool.layout for pool in state_pools)),
                   layout_text(layout, model.num_local_kv_heads, block_size),
                   tuple(run for _, run in page_groups(model.layer_specs())), state_pools=state_pools)

    def key(self, block_hash: int) -> str:
        return file_key(self.fingerprint, block_hash)

    # -- the KV coordinator's side (coordinator.LowerTier) --------------------------------------
    def holds(self, block_hash: int) -> bool:
        return self.is_enabled and self.key(block_hash) in self.store

    def fetch(self, block_hash: int, tokens: tuple[int, ...]) -> list[np.ndarray] | None:
        return self._read(self._header(self.key(block_hash), block_hash, tokens))

    def restore(self, pages: tuple[int, ...], data: list[np.ndarray]) -> None:
        self._restores.append((pages, data))

    def evicted(self, page_group: int, block_hash: int, tokens: tuple[int, ...], page: int) -> None:
        if self.is_enabled:
            self._evicted.setdefault(block_hash, (tokens, {}))[1][page_group] = page

    # A checkpoint is a slot's state in every state pool: a model without state pools has none.
    def holds_checkpoint(self, block_hash: int) -> bool:
        return self.is_enabled and bool(self.checkpoints) and all(c.holds(block_hash) for c in self.checkpoints)

    def fetch_checkpoint(self, block_hash: int, tokens: tuple[int, ...]) -> tuple[list[np.ndarray], ...] | None:
        fetched = []
        for checkpoints in self.checkpoints:
            if (data := checkpoints.fetch(block_hash, tokens)) is None:
                return None
            fetched.append(data)
        return tuple(fetched)

    def restore_checkpoint(self, slot: int, data: tuple[list[np.ndarray], ...]) -> None:
        for checkpoints, arrays in zip(self.checkpoints, data, strict=True):
            checkpoints.restore(slot, arrays)

    def _read(self, header: BlockHeader) -> list[np.ndarray] | None:
        """The arrays of the file `header` names, verified against it; None when it is not there, or bad: then
        it is deleted, with a warning, and what it held is recomputed."""
        data = self.store.read(header.key)
        if data is None:
            return None
        try:
            arrays = block_file.decode(data, header)
        except block_file.BadBlockFile as error:
            log.warning("disk prefix cache: deleted %s (%s); what it held is recomputed",
                        self.store.path(header.key), error)
            self.store.remove(header.key)
            self.num_bad_files += 1
            return None
        self.num_bytes_read += len(data)
        return arrays

    # -- the engine's side: between schedule and forward, and after the forward --------------------
    def before_forward(self, cached_page: CachedPage) -> list[PoolWrite]:
        """Save the blocks evicted this step (intact until the forward writes); the writes that fill the
        restored blocks and the restored checkpoints' state slots, which the step makes before its forward."""
        evicted, self._evicted = self._evicted, {}
        now = time.time_ns()
        self._save((block_hash, tokens, tuple(by_group[g] if g in by_group else cached_page(g, block_hash, tokens)
                                              for g in range(self._num_groups)), now)
                   for block_hash, (tokens, by_group) in evicted.items())
        restores, self._restores, writes = self._restores, [], []
        for index, (place, g) in enumerate(self._pieces):
            blocks = [(block_ids[g], data) for block_ids, data in restores if block_ids[g] != NULL_BLOCK]
            if not blocks:
                continue
            first = index * self._arrays_per_layer
            arrays = [np.concatenate([data[first + a] for _, data in blocks], axis=1)
                      for a in range(self._arrays_per_layer)]
            writes.append(PageWrite(place, [block_id for block_id, _ in blocks], arrays))
        for pool, checkpoints in enumerate(self.checkpoints):  # in the order of the runner's state pools
            writes += [SlotWrite(pool, slot, data) for slot, data in checkpoints.take_restores()]
        return writes

    def after_forward(self, chunks: Iterable[tuple[Sequence, ScheduledChunk, list[int]]], cached_page: CachedPage) -> None:
        """Save the full prompt blocks up to each prefill chunk's end that the disk does not hold yet (the
        prompt's blocks hit in memory too: a conversation's earlier replies are saved with the next turn),
        and mark those it holds as used. A sequence's blocks are used at its arrival time less their depth
        (ns): a chain's head stays newer than its tail, and the bound evicts tails first. The state pools'
        checkpoints the chunk wrote are saved too, each as recent as its block. `chunks`: (sequence, chunk,
        the chained hashes of the sequence's published blocks)."""
        if not self.is_enabled:
            return
        prompt_chunks = []
        for seq, chunk, block_hashes in chunks:
            end = min(chunk.start_position + len(chunk.token_ids), seq.num_prompt_tokens)
            if chunk.start_position < end:
                prompt_chunks.append(PromptChunk(seq, chunk, block_hashes, end, self._wall_ns(seq.arrival_time)))
        bs, seen, entries, uses, state_saves = self.block_size, set(), [], [], []
        for checkpoints in self.checkpoints:
            used, saves = checkpoints.after_forward(prompt_chunks)
            uses += used
            state_saves.append(saves)
        for seq, chunk, block_hashes, end, used_at in prompt_chunks:
            for index in range(end // bs):
                block_hash = block_hashes[index]
                key = self.key(block_hash)
                if key in seen or key in self.writer.pending_keys:
                    continue
                seen.add(key)
                if key in self.store:
                    uses.append((key, used_at - index))
                    continue
                tokens = seq.block_keys(index * bs, (index + 1) * bs)
                entries.append((block_hash, tokens, tuple(
                    table[index] if table[index] != NULL_BLOCK else cached_page(g, block_hash, tokens)
                    for g, table in enumerate(chunk.block_tables)), used_at - index))
        if uses:  # before the writes: their evictions must not take this prompt's head
            self.writer.touch(BlockTouch(tuple(uses)))
        self._save(entries)
        for checkpoints, saves in zip(self.checkpoints, state_saves):
            checkpoints.save(saves)

    def _wall_ns(self, monotonic_s: float) -> int:
        return self._wall_at_start_ns + int((monotonic_s - self._monotonic_at_start) * 1e9)

    def _save(self, entries: Iterable[tuple[int, tuple[int, ...], tuple[int | None, ...], int]]) -> None:
        """Queue host copies of these blocks (hash, tokens, page per page group, recency) for the writer: those
        every page group still holds, as many as fit."""
        entries = [entry for entry in entries if None not in entry[2] and self.key(entry[0]) not in self.store
                   and self.key(entry[0]) not in self.writer.pending_keys]
        room = self.writer.room(self.block_nbytes)
        self.num_writes_dropped += max(0, len(entries) - room)
        entries = entries[:room]
        if not entries:
            return
        piece_arrays = [self.cache.read_blocks(place, [entry[2][g] for entry in entries]) for place, g in self._pieces]
        bs = self.block_size
        for j, (block_hash, tokens, _, used_at) in enumerate(entries):
            arrays = [array[:, j * bs:(j + 1) * bs] for arrays in piece_arrays for array in arrays]
            header = self._header(self.key(block_hash), block_hash, tokens)
            if not self.writer.put(BlockWrite(header, arrays, self.block_nbytes, used_at)):
                self.num_writes_dropped += 1

    def _header(self, key: str, block_hash: int, tokens: tuple[int, ...]) -> BlockHeader:
        return BlockHeader(key, block_hash, tokens, self.fingerprint, self.layout, self._specs)

    # -- the rest -----------------------------------------------------------------------------
    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for the queued writes (tests, and a process about to exit)."""
        return self.writer.flush(timeout_s)

    def close(self) -> None:
        self.writer.close()

    def stats(self, num_hits: int, num_misses: int, num_checkpoint_hits: int = 0) -> DiskCacheStats:
        w = self.writer
        dropped = self.num_writes_dropped + sum(checkpoints.num_writes_dropped for checkpoints in self.checkpoints)
        return DiskCacheStats(
            directory=str(self.store.directory), is_enabled=self.is_enabled, capacity_bytes=self.store.capacity_bytes,
            num_bytes=self.store.num_bytes, num_files=self.store.num_files, num_hits=num_hits, num_misses=num_misses,
            num_bytes_read=self.num_bytes_read, num_bytes_written=w.num_bytes_written,
            num_files_written=w.num_files_written, num_writes_dropped=dropped,
            num_bad_files=self.num_bad_files, num_write_errors=w.num_errors, num_checkpoint_hits=num_checkpoint_hits,
        )


class DiskTierStage:
    """The disk tier at the step's run stage: evicted blocks saved and restored ones filled before the
    forward overwrites them, the prompt blocks computed saved after it."""

    def __init__(self, tier: DiskTier, kv_coordinator: KVCoordinator, seq_of: Callable[[int], Sequence],
                 stage_writes: Callable[[list[PoolWrite]], None]):
        """`stage_writes`: the runner's (its step writes the restores into the pools' arrays)."""
        self.tier, self.kv_coordinator, self._seq_of, self._stage_writes = tier, kv_coordinator, seq_of, stage_writes

    def before_forward(self, batch: ScheduledBatch) -> None:
        self._stage_writes(self.tier.before_forward(self.kv_coordinator.cached_page))

    def after_forward(self, batch: ScheduledBatch) -> None:
        chunks = ((self._seq_of(c.seq_id), c, self.kv_coordinator.block_hashes(c.seq_id)) for c in batch.chunks)
        self.tier.after_forward(chunks, self.kv_coordinator.cached_page)
