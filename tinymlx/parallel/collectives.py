"""One rank's handle on the tensor-parallel group: the model's collectives and rank 0's broadcasts, counted.

All run over the same ring. A broadcast is an all-sum to which only rank 0 contributes (the others
add zeros): a fixed header [command, payload length], then the payload.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import TypeVar

import mlx.core as mx
import numpy as np

from tinymlx.core.outputs import CommCounts
from tinymlx.parallel.step_broadcast import Command

T = TypeVar("T")


class Collectives:
    def __init__(self, group: mx.distributed.Group):
        self.group, self.rank, self.size = group, group.rank(), group.size()
        self._counts = dict.fromkeys((f.name for f in dataclasses.fields(CommCounts)), 0)

    @property
    def counts(self) -> CommCounts:
        return CommCounts(**self._counts)

    def _count(self, kind: str, nbytes: int, calls: int = 1) -> None:
        self._counts[f"num_{kind}s"] += calls
        self._counts[f"{kind}_bytes"] += nbytes

    def all_reduce(self, x: mx.array) -> mx.array:
        """Sum `x` over the ranks (lazily, inside the forward's graph). Counted when the graph is built,
        which happens exactly once per executed call."""
        self._count("all_reduce", x.nbytes)
        return mx.distributed.all_sum(x, group=self.group)

    def gather_vocab(self, logits: mx.array) -> mx.array:
        """[rows, vocab/p] on each rank -> [rows, vocab] in rank order (lazily, like all_reduce)."""
        self._count("all_gather", logits.nbytes)
        rows, columns = logits.shape
        gathered = mx.distributed.all_gather(logits, group=self.group)  # [p * rows, columns]
        return gathered.reshape(self.size, rows, columns).transpose(1, 0, 2).reshape(rows, self.size * columns)

    def broadcast(self, command: Command | None = None, payload: np.ndarray | None = None
                  ) -> tuple[Command, np.ndarray]:
        """Rank 0 passes a command and its payload; every other rank receives them."""
        is_root = self.rank == 0
        header = np.array([command or 0, 0 if payload is None else payload.size], dtype=np.int32)
        header = self._sum_now(header if is_root else np.zeros_like(header))
        length = int(header[1])
        body = np.zeros(length, dtype=np.int32)
        if length:
            body = self._sum_now(payload.astype(np.int32) if is_root else body)
        return Command(int(header[0])), body

    def agree(self, values: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Element-wise (min, max) of `values` over the ranks: equal exactly when every rank agrees."""
        local = mx.array(np.array(values, dtype=np.int32))
        low = mx.distributed.all_min(local, group=self.group)
        high = mx.distributed.all_max(local, group=self.group)
        self._count("broadcast", 2 * local.nbytes, calls=2)
        return np.array(low), np.array(high)

    def time_all_reduce(self, rows: int, columns: int, repeats: int) -> list[float]:
        """Seconds for each of `repeats` all-reduces of a float32 [rows, columns] array; every rank
        must call this with the same arguments (Command.PROBE). Not counted."""
        x = mx.zeros((rows, columns), dtype=mx.float32)
        mx.eval(x)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            mx.eval(mx.distributed.all_sum(x, group=self.group))
            times.append(time.perf_counter() - start)
        return times

    def _sum_now(self, array: np.ndarray) -> np.ndarray:
        self._count("broadcast", array.nbytes)
        return np.array(mx.distributed.all_sum(mx.array(array), group=self.group))


def build_on_every_rank(build: Callable[[], T], fingerprint: Callable[[T], list[int]], length: int,
                        agree: Callable[[list[int]], tuple[np.ndarray, np.ndarray]]
                        ) -> tuple[T | None, Exception | None, bool]:
    """Run `build` on this rank, then agree with the others (`Collectives.agree`) whether every rank
    succeeded with the same fingerprint. Returns (result, this rank's error, agreed). A rank that
    failed still takes part (with `length` zeros for a fingerprint), so no rank is left waiting.
    """
    result, error = None, None
    try:
        result = build()
        values = [1, *fingerprint(result)]
    except Exception as failure:  # noqa: BLE001 - every rank hears of it below; the caller raises it
        error = failure
        values = [0] * (1 + length)
    low, high = agree(values)
    return result, error, bool(low[0] == 1 and (low == high).all())
