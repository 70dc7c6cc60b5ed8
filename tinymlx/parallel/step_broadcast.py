"""What rank 0 sends the other ranks, packed into one int32 array for `Collectives.broadcast`.

Commands arrive in the order rank 0 sent them, and every rank takes part in every broadcast, so
the workers cannot run anything rank 0 did not: they mirror its sequence of forwards exactly.

    packed arrays:  [count, ndim_0, *shape_0, ndim_1, *shape_1, ..., data_0, data_1, ...]
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np


class Command(IntEnum):
    STEP = 1  # payload: the step's StepInputs arrays; every rank runs the same forward
    LOAD = 2  # payload: JSON {model_dir, config}; every rank loads its shard and builds its KV pool
    RELEASE = 3  # drop the model and the pool; the ranks wait for the next LOAD
    SHUTDOWN = 4  # the worker processes exit
    PROBE = 5  # payload: [rows, columns, repeats]; time all-reduces of that shape (benchmarks)


def pack_arrays(arrays: list[np.ndarray]) -> np.ndarray:
    header = [len(arrays)]
    for array in arrays:
        header += [array.ndim, *array.shape]
    return np.concatenate([np.array(header, dtype=np.int32), *(a.astype(np.int32).ravel() for a in arrays)])


def unpack_arrays(packed: np.ndarray) -> list[np.ndarray]:
    count, cursor, shapes = int(packed[0]), 1, []
    for _ in range(count):
        ndim = int(packed[cursor])
        shapes.append(tuple(int(d) for d in packed[cursor + 1:cursor + 1 + ndim]))
        cursor += 1 + ndim
    arrays = []
    for shape in shapes:
        size = int(np.prod(shape))
        arrays.append(packed[cursor:cursor + size].reshape(shape))
        cursor += size
    return arrays


def pack_text(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


def unpack_text(packed: np.ndarray) -> str:
    return packed.astype(np.uint8).tobytes().decode("utf-8")
