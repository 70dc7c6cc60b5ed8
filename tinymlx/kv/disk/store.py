"""DiskStore: a directory of block files under a size bound, the least recently used removed first.

Recency is each file's mtime, set explicitly (nanoseconds) by the writer: the disk tier gives the blocks
of a prompt one time, minus their depth in the chain, so a chain's head is always newer than its tail and
eviction takes tails first (a tail without its head is unreachable). The index (key -> mtime, size, and a
heap of mtimes for eviction) is built by one scan of the directory; a periodic rescan picks up the files
of other processes sharing it. Files are written under a temporary name in the same directory and renamed
into place (os.replace is atomic): a reader, in this process or another, sees a whole file or none.

Thread-safe: the engine thread reads and removes, the writer thread writes, touches and evicts.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import re
import threading
import time
from collections.abc import Iterable
from pathlib import Path

SUFFIX = ".kvb"
_NAME = re.compile(r"^[0-9a-f]{32}\.kvb$")
_TEMP_SUFFIX = ".tmp"
_STALE_TEMP_S = 3600.0  # a temporary file this old was left by a writer that died


class DiskStore:
    def __init__(self, directory: str | os.PathLike, capacity_bytes: int):
        self.directory, self.capacity_bytes = Path(directory), capacity_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._files: dict[str, tuple[int, int]] = {}  # key -> (mtime ns, size)
        self._heap: list[tuple[int, str]] = []  # (mtime ns, key), stale entries skipped when popped
        self.num_bytes = 0
        self.scan()

    @property
    def num_files(self) -> int:
        return len(self._files)

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def __contains__(self, key: str) -> bool:
        return key in self._files

    def keys(self) -> list[str]:
        """Every file's key, least recently used first."""
        with self._lock:
            return [key for _, key in sorted((mtime, key) for key, (mtime, _) in self._files.items())]

    def scan(self) -> None:
        """Rebuild the index from the directory, and keep it under the bound."""
        files, now = {}, time.time()
        with os.scandir(self.directory) as entries:
            for entry in entries:
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # another process removed it meanwhile
                    continue
                if _NAME.match(entry.name):
                    files[entry.name[:-len(SUFFIX)]] = (stat.st_mtime_ns, stat.st_size)
                elif entry.name.endswith(_TEMP_SUFFIX) and now - stat.st_mtime > _STALE_TEMP_S:
                    Path(entry.path).unlink(missing_ok=True)
        with self._lock:
            self._files = files
            self._heap = sorted((mtime, key) for key, (mtime, _) in files.items())
            self.num_bytes = sum(size for _, size in files.values())
        self._evict_to(self.capacity_bytes)

    def read(self, key: str) -> bytes | None:
        """The file's bytes, or None when it is not there."""
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:  # evicted by another process sharing the directory
            self._forget(key)
            return None

    def write(self, key: str, pieces: Iterable[bytes | memoryview], mtime_ns: int) -> int:
        """Write the file whole under its key, used at `mtime_ns`; then evict past the bound. Its size."""
        temp = self.directory / f".{key}.{os.getpid()}.{threading.get_ident()}{_TEMP_SUFFIX}"
        size = 0
        try:
            with open(temp, "wb") as file:
                for piece in pieces:
                    file.write(piece)
                    size += len(piece)
            os.utime(temp, ns=(mtime_ns, mtime_ns))
            os.replace(temp, self.path(key))
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        with self._lock:
            self.num_bytes += size - self._files.get(key, (0, 0))[1]
            self._record(key, mtime_ns, size)
        self._evict_to(self.capacity_bytes)
        return size

    def touch(self, key: str, mtime_ns: int) -> None:
        """Mark a file used at `mtime_ns` (for this index, and on disk for the next scan)."""
        with self._lock:
            if self._files.get(key, (mtime_ns,))[0] == mtime_ns:
                return  # not there, or already marked so
            self._record(key, mtime_ns, self._files[key][1])
        with contextlib.suppress(OSError):  # gone meanwhile, or a read-only directory: the order is a hint
            os.utime(self.path(key), ns=(mtime_ns, mtime_ns))

    def remove(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)
        self._forget(key)

    def clear(self) -> int:
        """Remove every block file (and temporary file) in the directory; the bytes freed."""
        freed = 0
        with os.scandir(self.directory) as entries:
            for entry in entries:
                if _NAME.match(entry.name) or entry.name.endswith(_TEMP_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        freed += entry.stat().st_size
                        Path(entry.path).unlink()
        with self._lock:
            self._files, self._heap, self.num_bytes = {}, [], 0
        return freed

    def _record(self, key: str, mtime_ns: int, size: int) -> None:
        self._files[key] = (mtime_ns, size)
        heapq.heappush(self._heap, (mtime_ns, key))
        if len(self._heap) > 2 * len(self._files) + 1024:  # drop the stale entries now and then
            self._heap = sorted((mtime, key) for key, (mtime, _) in self._files.items())

    def _forget(self, key: str) -> None:
        with self._lock:
            self.num_bytes -= self._files.pop(key, (0, 0))[1]

    def _evict_to(self, num_bytes: int) -> None:
        while True:
            with self._lock:
                if self.num_bytes <= num_bytes or not self._heap:
                    return
                mtime, key = heapq.heappop(self._heap)
                if self._files.get(key, (None,))[0] != mtime:
                    continue  # stale: the file was touched, rewritten or removed since
                self.num_bytes -= self._files.pop(key)[1]
            self.path(key).unlink(missing_ok=True)
