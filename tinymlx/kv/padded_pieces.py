"""A step's pieces (chunks, or a chunk's query tiles) padded to one shape [B, L], as attention and the
state pools compute them: padding repeats a piece's last token, and is dropped from the flattened output."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def padded_steps(lengths: np.ndarray) -> np.ndarray:
    """[B, L] step of each padded query within its piece: padding repeats the piece's last token."""
    return np.minimum(np.arange(int(lengths.max()))[None, :], lengths[:, None] - 1)


def unpad_index(lengths: np.ndarray) -> mx.array | None:
    """Rows of a flattened [B * L] output that are real tokens; None where no piece is padded."""
    L = int(lengths.max())
    if (lengths == L).all():
        return None
    return mx.array(np.flatnonzero(np.arange(L)[None, :] < lengths[:, None]).astype(np.int32))


def unpadded(out: mx.array, index: mx.array | None) -> mx.array:
    """[B, L, ...] -> the real tokens' rows [n, ...] (`index`: unpad_index's)."""
    out = out.reshape(-1, *out.shape[2:])
    return out if index is None else out[index]
