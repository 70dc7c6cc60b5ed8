"""One full KV block (or a hybrid model's state checkpoint: kv/disk/checkpoints.py) on disk: a
self-describing file the disk tier writes and verifies before use.

    offset 0   magic  b"TMLXKVB\\n"                          8 bytes
           8   format version, header length (little-endian u32 each)
          16   header: JSON {key, block_hash, tokens, fingerprint, layout, arrays: [[shape, dtype], ...]}
           .   payload: the arrays' bytes, C order, one after another
         end   CRC-32 of everything before it (u32)

The checksum is CRC-32 (1.7 GB/s here, against BLAKE2b's 0.25 GB/s): it finds a torn or flipped file,
and the header finds a foreign one (another model, layout or block). Any mismatch raises BadBlockFile.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

MAGIC = b"TMLXKVB\n"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sII")
_CRC = struct.Struct("<I")

ArraySpec = tuple[tuple[int, ...], str]  # (shape, NumPy dtype name)


class BadBlockFile(ValueError):
    """A block file that must not be loaded: truncated, corrupted, or written for something else."""


@dataclass(frozen=True)
class BlockHeader:
    key: str  # the file's name: digest of the fingerprint and the block's chain hash
    block_hash: int  # the prefix cache's chain hash (prefix_cache.chain_hash)
    tokens: tuple[int, ...]
    fingerprint: str  # the model, its dtype and the KV layout (model_fingerprint.py)
    layout: str  # the KV layout in words, for a reader to check and a person to read
    arrays: tuple[ArraySpec, ...]

    def to_json(self) -> bytes:
        return json.dumps({"key": self.key, "block_hash": f"{self.block_hash:032x}", "tokens": list(self.tokens),
                           "fingerprint": self.fingerprint, "layout": self.layout,
                           "arrays": [[list(shape), dtype] for shape, dtype in self.arrays]}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> BlockHeader:
        fields = json.loads(data)
        return cls(fields["key"], int(fields["block_hash"], 16), tuple(fields["tokens"]), fields["fingerprint"],
                   fields["layout"], tuple((tuple(shape), dtype) for shape, dtype in fields["arrays"]))


def encode(header: BlockHeader, arrays: list[np.ndarray]) -> Iterator[bytes | memoryview]:
    """The file's pieces in order (written one by one: the payload is never joined into one copy)."""
    assert [(a.shape, a.dtype.name) for a in arrays] == list(header.arrays), "arrays differ from the header"
    meta = header.to_json()
    pieces = [_PREFIX.pack(MAGIC, FORMAT_VERSION, len(meta)), meta]
    pieces += [memoryview(np.ascontiguousarray(a)).cast("B") for a in arrays]
    crc = 0
    for piece in pieces:
        crc = zlib.crc32(piece, crc)
        yield piece
    yield _CRC.pack(crc)


def decode(data: bytes, expected: BlockHeader) -> list[np.ndarray]:
    """The arrays of a file whose header equals `expected`, as read-only views of `data`."""
    if len(data) < _PREFIX.size + _CRC.size:
        raise BadBlockFile(f"truncated: {len(data)} bytes")
    magic, version, meta_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise BadBlockFile("not a tinymlx KV block file")
    if version != FORMAT_VERSION:
        raise BadBlockFile(f"format version {version}, not {FORMAT_VERSION}")
    (crc,) = _CRC.unpack_from(data, len(data) - _CRC.size)
    if zlib.crc32(memoryview(data)[:-_CRC.size]) != crc:
        raise BadBlockFile("checksum mismatch (truncated or corrupted)")
    payload_start = _PREFIX.size + meta_len
    try:
        header = BlockHeader.from_json(data[_PREFIX.size:payload_start])
    except (ValueError, KeyError, TypeError) as error:
        raise BadBlockFile(f"unreadable header: {error}") from None
    for field in ("fingerprint", "layout", "key", "block_hash", "tokens", "arrays"):
        if getattr(header, field) != getattr(expected, field):
            raise BadBlockFile(f"written for another {field.replace('_', ' ')}")
    sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in expected.arrays]
    if len(data) != payload_start + sum(sizes) + _CRC.size:
        raise BadBlockFile(f"{len(data)} bytes, not the {payload_start + sum(sizes) + _CRC.size} its arrays take")
    arrays, offset = [], payload_start
    for (shape, dtype), size in zip(expected.arrays, sizes):
        arrays.append(np.frombuffer(data, dtype=dtype, count=size // np.dtype(dtype).itemsize, offset=offset)
                      .reshape(shape))
        offset += size
    return arrays
