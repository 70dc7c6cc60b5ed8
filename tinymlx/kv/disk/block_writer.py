"""BlockWriter: the disk tier's writer thread. The engine hands it host copies of blocks; it encodes and
writes them (block_file.py, disk_store.py) off the engine thread. Its queue is bounded in bytes: when a
write would not fit, the caller drops it (the block is only recomputed if it is ever needed), so the
engine never waits for the disk."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import NamedTuple

import numpy as np

from tinymlx.kv.disk import block_file
from tinymlx.kv.disk.block_file import BlockHeader
from tinymlx.kv.disk.store import DiskStore

log = logging.getLogger(__name__)

RESCAN_S = 60.0  # how often the index is rebuilt from the directory (other processes' files, their evictions)


class BlockWrite(NamedTuple):
    header: BlockHeader
    arrays: list[np.ndarray]
    nbytes: int  # the arrays' bytes, counted against the queue's bound
    mtime_ns: int  # its recency (disk_store.py)


class BlockTouch(NamedTuple):
    """Files used again: (key, recency) each, applied in order with the writes around them."""

    uses: tuple[tuple[str, int], ...]


class BlockWriter:
    def __init__(self, store: DiskStore, max_pending_bytes: int):
        self.store, self.max_pending_bytes = store, max_pending_bytes
        self.num_pending = self.num_pending_bytes = 0
        self.num_bytes_written = self.num_files_written = self.num_errors = 0
        self.pending_keys: set[str] = set()  # queued or being written
        self._lock = threading.Lock()
        self._queue: queue.Queue[BlockWrite | BlockTouch | None] = queue.Queue()
        self._last_scan = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="tinymlx-disk-writer", daemon=True)
        self._thread.start()

    def room(self, nbytes: int) -> int:
        """How many writes of `nbytes` each fit in the queue now."""
        return max(0, self.max_pending_bytes - self.num_pending_bytes) // max(1, nbytes)

    def put(self, write: BlockWrite) -> bool:
        """Queue a write; False (and nothing queued) when it does not fit."""
        with self._lock:
            if self.num_pending_bytes + write.nbytes > self.max_pending_bytes:
                return False
            self.num_pending += 1
            self.num_pending_bytes += write.nbytes
            self.pending_keys.add(write.header.key)
        self._queue.put(write)
        return True

    def touch(self, touch: BlockTouch) -> None:
        with self._lock:
            self.num_pending += 1
        self._queue.put(touch)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write is done; False if `timeout_s` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.num_pending:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the queued writes (up to `timeout_s`), then stop the thread."""
        if not self._thread.is_alive():
            return
        self.flush(timeout_s)
        self._queue.put(None)
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while True:
            try:
                write = self._queue.get(timeout=RESCAN_S)
            except queue.Empty:
                write = False
            if write is None:
                return
            if time.monotonic() - self._last_scan > RESCAN_S:
                self._last_scan = time.monotonic()
                self._guarded(self.store.scan)
            if isinstance(write, BlockTouch):
                for key, mtime_ns in write.uses:
                    self._guarded(self.store.touch, key, mtime_ns)
                with self._lock:
                    self.num_pending -= 1
            elif write:
                self._guarded(self._write, write)
                with self._lock:
                    self.num_pending -= 1
                    self.num_pending_bytes -= write.nbytes
                    self.pending_keys.discard(write.header.key)

    def _write(self, write: BlockWrite) -> None:
        size = self.store.write(write.header.key, block_file.encode(write.header, write.arrays), write.mtime_ns)
        self.num_bytes_written += size
        self.num_files_written += 1

    def _guarded(self, work, *args) -> None:
        try:
            work(*args)
        except OSError as error:  # a full or read-only disk: the tier goes on, and says so (once in a while)
            self.num_errors += 1
            if self.num_errors in (1, 10, 100) or self.num_errors % 1000 == 0:
                log.warning("disk prefix cache: %s (%d errors so far)", error, self.num_errors)
