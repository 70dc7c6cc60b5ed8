"""A GGUF's metadata and tensors, read straight from the layout the GGUF spec gives:

    magic "GGUF", version u32, tensor count u64, metadata count u64
    metadata:  key (u64 length + bytes), value type u32, value   (arrays: item type u32, count u64, items)
    tensors:   name, dimension count u32, dimensions u64 each, type u32, offset u64
    padding to the alignment (general.alignment, default 32), then the tensors' data

gguf-py's GGUFReader builds numpy views of every metadata value, one per string: 13 s of the 17 s before
gemma-3-270m's conversion wrote a byte (a 262k-token vocabulary, on 2 busy cores). This reads the same
values (as its `field.contents()` gives them) in about 0.2 s; tensors are views of the memory-mapped file,
shaped as GGUFReader shapes them.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from tinymlx.core.errors import ModelLoadError

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}  # by type id
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32
_ELEMENT_TYPES = {  # tensors of these types are views of their elements; the rest are bytes, a row of blocks a row
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}
_U64 = struct.Struct("<Q")


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: fastest dimension first
    n_elements: int
    n_bytes: int
    data_offset: int  # in the file
    data: np.ndarray  # read-only view of the file: elements, or uint8 rows of blocks

    @property
    def numpy_shape(self) -> tuple[int, ...]:
        """Slowest dimension first, as numpy, safetensors and Hugging Face order them."""
        return tuple(reversed(self.shape))


class GGUFFile(NamedTuple):
    path: Path
    metadata: dict[str, Any]  # key -> value; "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count" too
    tensors: list[GGUFTensor]


def read_gguf(path: str | Path) -> GGUFFile:
    """The metadata and tensors of the GGUF at `path`. Raises ValueError (or struct.error, KeyError) for a
    file that is not a well-formed little-endian GGUF, or whose tensors run past its end."""
    path = Path(path)
    data = np.memmap(path, mode="r")
    buf = memoryview(data)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError("it does not start with the GGUF magic bytes")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are; a big-endian file reads as another)")
    num_tensors, num_fields = struct.unpack_from("<QQ", buf, 8)
    metadata: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": num_tensors, "GGUF.kv_count": num_fields}
    at = 24
    for _ in range(num_fields):
        key, at = _string(buf, at)
        if key in metadata:
            raise ValueError(f"metadata key {key!r} appears twice")
        (kind,) = struct.unpack_from("<I", buf, at)
        metadata[key], at = _value(buf, at + 4, kind)
    index = []
    for _ in range(num_tensors):
        name, at = _string(buf, at)
        (num_dims,) = struct.unpack_from("<I", buf, at)
        dims = struct.unpack_from(f"<{num_dims}Q", buf, at + 4)
        kind, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * num_dims)
        index.append((name, dims, GGMLQuantizationType(kind), offset))
        at += 4 + 8 * num_dims + 12
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    start = at + -at % alignment
    return GGUFFile(path, metadata, _tensors(data, start, index))


def num_weights(path: str | Path) -> int:
    """The number of weights in every tensor of the GGUF at `path` (what `auto` sizes the float copy by)."""
    try:
        return sum(tensor.n_elements for tensor in read_gguf(path).tensors)
    except (struct.error, KeyError, ValueError) as error:
        raise ModelLoadError(f"{path} is a corrupt or truncated GGUF file ({error})") from None


def _tensors(data: np.memmap, start: int, index: list) -> list[GGUFTensor]:
    tensors, names = [], set()
    for name, dims, kind, offset in index:
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        n_elements = math.prod(dims)
        block_size, type_size = GGML_QUANT_SIZES[kind]
        n_bytes = n_elements * type_size // block_size
        begin = start + offset
        if begin + n_bytes > data.size:
            raise ValueError(f"its tensors need {begin + n_bytes:,} bytes")
        shape = tuple(reversed(dims))  # numpy's order: slowest first
        if kind in _ELEMENT_TYPES:
            view = data[begin:begin + n_bytes].view(_ELEMENT_TYPES[kind]).reshape(shape)
        else:
            view = data[begin:begin + n_bytes].reshape(quant_shape_to_byte_shape(shape, kind))
        tensors.append(GGUFTensor(name, kind, tuple(dims), n_elements, n_bytes, begin, view))
    return tensors


def _string(buf: memoryview, at: int) -> tuple[str, int]:
    (length,) = _U64.unpack_from(buf, at)
    end = at + 8 + length
    if end > len(buf):
        raise ValueError("a string runs past the end of the file")
    return str(buf[at + 8:end], "utf-8"), end


def _value(buf: memoryview, at: int, kind: int) -> tuple[Any, int]:
    if kind == _STRING:
        return _string(buf, at)
    if kind in _SCALARS:
        fmt = "<" + _SCALARS[kind]
        return struct.unpack_from(fmt, buf, at)[0], at + struct.calcsize(fmt)
    if kind != _ARRAY:
        raise ValueError(f"unknown metadata value type {kind}")
    item, count = struct.unpack_from("<IQ", buf, at)
    at += 12
    if item in _SCALARS:  # numbers: one numpy read, not one per item
        dtype = np.dtype("<" + _SCALARS[item])
        end = at + count * dtype.itemsize
        if end > len(buf):
            raise ValueError("an array runs past the end of the file")
        return np.frombuffer(buf[at:end], dtype).tolist(), end
    if item == _STRING:  # a vocabulary: hundreds of thousands of them, so the loop stays tight
        items = []
        for _ in range(count):
            text, at = _string(buf, at)
            items.append(text)
        return items, at
    items = []
    for _ in range(count):
        value, at = _value(buf, at, item)
        if isinstance(value, list):  # GGUFReader flattens arrays of arrays; so do we
            items.extend(value)
        else:
            items.append(value)
    return items, at
