"""A GGUF's tensors streamed into a safetensors file a few rows at a time: peak memory is a chunk of a
tensor, not the model, and the progress meter moves within a big tensor (gemma-3-270m's embedding is
640 MiB of its 1023 MiB in float32). What each tensor becomes is the caller's plan (gguf.py).

A tensor is converted as rows: its dimensions but the last (a matrix's rows, an expert stack's rows of
all experts) flattened, in the order they are stored; a vector is one row.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from tinymlx.loader.gguf_file import GGUFTensor
from tinymlx.loader.progress import StageMeter

CHUNK_BYTES = 16 << 20  # rows are converted and written about this many output bytes at a time
ITEM_SIZE = {"F32": 4, "BF16": 2, "F16": 2, "U32": 4, "U8": 1}


class WeightPlan(NamedTuple):
    """How a GGUF's tensors become safetensors entries."""

    layout: dict[str, list[tuple[str, str, tuple[int, ...]]]]  # GGUF tensor -> its (name, safetensors dtype, shape)
    heads: dict[str, int]  # tensor -> the heads llama.cpp interleaved its rows within (Q/K of some families)
    encode: Callable[[GGUFTensor, slice], list]  # a tensor's rows (see as_rows) -> one buffer per entry


def entry_bytes(entry: tuple[str, str, tuple[int, ...]]) -> int:
    _, st_dtype, shape = entry
    return ITEM_SIZE[st_dtype] * math.prod(shape)


def write_weights(tensors: list[GGUFTensor], plan: WeightPlan, out: Path, meter: StageMeter) -> None:
    """Write every tensor's entries, in order, advancing `meter` by the bytes of each chunk."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for entries in plan.layout.values():
        for entry in entries:
            name, st_dtype, shape = entry
            header[name] = {"dtype": st_dtype, "shape": shape, "data_offsets": [offset, offset + entry_bytes(entry)]}
            offset += entry_bytes(entry)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)  # safetensors aligns the data to 8 bytes
    data_start = 8 + len(blob)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for tensor in tensors:
            entries = plan.layout[tensor.name]
            # Each entry's rows land in its own span (a native tensor's weight, then scales, then biases).
            ends = [data_start + header[name]["data_offsets"][0] for name, _, _ in entries]
            row_bytes = sum(entry_bytes(entry) for entry in entries) // max(1, num_rows(tensor))
            for rows in _row_slices(num_rows(tensor), row_bytes, plan.heads.get(tensor.name)):
                for i, buffer in enumerate(plan.encode(tensor, rows)):
                    f.seek(ends[i])
                    f.write(buffer)
                    ends[i] += buffer.nbytes
                    meter.advance(buffer.nbytes)


def num_rows(tensor: GGUFTensor) -> int:
    return math.prod(tensor.numpy_shape[:-1])


def as_rows(tensor: GGUFTensor) -> np.ndarray:
    return tensor.data.reshape(num_rows(tensor), -1)


def heads_in(heads: dict[str, int], tensor: GGUFTensor, rows: slice) -> int | None:
    """How many heads' interleaved rows `rows` of `tensor` hold (None: the tensor is not permuted)."""
    if tensor.name not in heads:
        return None
    return heads[tensor.name] * (rows.stop - rows.start) // num_rows(tensor)


def _row_slices(count: int, row_bytes: int, num_heads: int | None) -> list[slice]:
    """Rows in runs of about CHUNK_BYTES out; of a permuted tensor (`num_heads`), whole heads, within
    which its rows unpermute."""
    unit = 1 if num_heads is None else max(1, count // num_heads)
    step = max(1, CHUNK_BYTES // max(1, row_bytes * unit)) * unit
    return [slice(start, min(start + step, count)) for start in range(0, count, step)]
