"""How many weights a GGUF holds, read from its tensor index alone.

gguf-py's GGUFReader parses every metadata value into Python objects: 13 s for the 0.5B's 151k-token
vocabulary on 2 cores. Choosing a dtype for `auto` needs only the tensors' shapes, so this walks the
header the GGUF spec lays out and skips the values (the vocabulary in about 0.1 s):

    magic "GGUF", version u32, tensor count u64, metadata count u64
    metadata:  key (u64 length + bytes), value type u32, value   (arrays: item type u32, count u64, items)
    tensors:   name, dimension count u32, dimensions u64 each, type u32, offset u64
"""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path

from tinymlx.errors import ModelLoadError

# GGUF value types by id: fixed sizes; 8 is a string, 9 an array.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def num_weights(path: str | Path) -> int:
    """The number of weights in every tensor of the GGUF at `path`."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            return _count(data)
        except (struct.error, KeyError, ValueError) as error:
            raise ModelLoadError(f"{path} is a corrupt or truncated GGUF file ({error})") from None


def _count(data: mmap.mmap) -> int:
    if data[:4] != b"GGUF":
        raise ValueError("it does not start with the GGUF magic bytes")
    num_tensors, num_fields = struct.unpack_from("<QQ", data, 8)
    at = 24
    for _ in range(num_fields):
        at = _skip_string(data, at)
        (kind,) = struct.unpack_from("<I", data, at)
        at = _skip_value(data, at + 4, kind)
    total = 0
    for _ in range(num_tensors):
        at = _skip_string(data, at)
        (num_dims,) = struct.unpack_from("<I", data, at)
        total += math.prod(struct.unpack_from(f"<{num_dims}Q", data, at + 4))
        at += 4 + 8 * num_dims + 4 + 8
    return total


def _skip_string(data: mmap.mmap, at: int) -> int:
    (length,) = struct.unpack_from("<Q", data, at)
    return at + 8 + length


def _skip_value(data: mmap.mmap, at: int, kind: int) -> int:
    if kind == _STRING:
        return _skip_string(data, at)
    if kind != _ARRAY:
        return at + _FIXED[kind]
    item, count = struct.unpack_from("<IQ", data, at)
    at += 12
    if item in _FIXED:
        return at + count * _FIXED[item]
    for _ in range(count):
        at = _skip_value(data, at, item)
    return at
