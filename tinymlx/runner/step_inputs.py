"""StepInputs: one step as host arrays, identical on every rank: what ModelRunner.prepare makes of a
ScheduledBatch, and what a tensor-parallel step broadcast carries (`to_arrays` / `from_arrays`, int32)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tinymlx.kv.state_pool import StateInputs, StatePool
from tinymlx.vision.encoder_cache import ImagePiece


class GroupInputs(NamedTuple):
    """One attention group as host arrays: B pieces padded to L queries (see `_attention_groups`).
    The blocks a piece reads, and the position of the first key they hold, differ per KV group: a
    sliding window's start where it reaches back to."""

    token_index: np.ndarray  # [B, L] row of each query in the flat batch (padding repeats a real one)
    positions: np.ndarray  # [B, L] position of each query
    lengths: np.ndarray  # [B] real queries of each piece
    block_tables: tuple[np.ndarray, ...]  # per page group: [B, pages read] (padding: page 0, masked out)
    first_key_positions: tuple[np.ndarray, ...]  # per page group: [B] position of the first key gathered
    # [B, L, 2]: the (start, end) of the image each query lies in, whose keys it sees both ways; (-1, -1)
    # outside. Only where the model's images attend both ways and a piece has images (rank 0 only, never sent).
    image_spans: np.ndarray | None = None


class StepInputs(NamedTuple):
    """Everything a forward needs, identical on every rank."""

    tokens: np.ndarray  # [N] flat tokens of the step, group by group
    positions: np.ndarray  # [N]
    slot_mapping: np.ndarray  # [page_groups, N] each token's new K/V slot in each page group's pages
    sample_index: np.ndarray  # [S] rows of the flat batch whose logits are sampled, in batch order
    groups: tuple[GroupInputs, ...]
    states: tuple[StateInputs, ...] = ()  # each state pool's view of the step, in the runner's order of pools
    row_of: dict[tuple[int, int], int] | None = None  # (seq, position) -> its flat row; rank 0 only, never sent
    # Steps with images only (core/images.py):
    rope_positions: np.ndarray | None = None  # [3, N] M-RoPE positions, where the model has them
    image_rows: np.ndarray | None = None  # [M] rows of the flat batch that are image tokens
    image_pieces: tuple[ImagePiece, ...] = ()  # the images (and token ranges) those rows take; rank 0 only
    # [M, hidden] float32: those rows' features, which rank 0's encoder cache gives the other ranks (the
    # tower runs on rank 0 alone under tensor parallelism: `with_image_features`)
    image_features: np.ndarray | None = None
    # [P, 2] (flat row, row of the step before's draws): rows whose token is that draw, still on the device
    # (a chunk's `pending_row`; `tokens` holds 0 there until the forward takes it). Rank 0 only, never sent:
    # tensor-parallel steps never run ahead.
    pending_rows: np.ndarray | None = None
    # [1 + state pools]: the batch's PoolExtent (core/batch.py), the KV pages then each state pool's slots
    # (None: a draft's batch, whose pool grows to the pages it reads)
    extent: np.ndarray | None = None

    def to_arrays(self) -> list[np.ndarray]:
        """Flat, for the step broadcast (int32 arrays): the four arrays above, the counts [attention groups,
        flags, then the arrays of each state pool's inputs], then each group's arrays, the image arrays the
        flags name (features as their float32 bits), the extent where the flags say, then each state pool's."""
        states, flags = [inputs.to_arrays() for inputs in self.states], self._flags
        counts = np.array([len(self.groups), flags, *(len(arrays) for arrays in states)], dtype=np.int32)
        arrays = [self.tokens, self.positions, self.slot_mapping, self.sample_index, counts,
                  *(array for group in self.groups for array in (*group[:3], *group.block_tables,
                                                                 *group.first_key_positions))]
        if flags & _SPANS:
            arrays += [group.image_spans if group.image_spans is not None
                       else np.full((*group.positions.shape, 2), -1, dtype=np.int32) for group in self.groups]
        if flags & _ROPE:
            arrays.append(self.rope_positions)
        if flags & _FEATURES:
            assert self.image_features is not None, "rank 0 fills the features in first (with_image_features)"
            arrays += [self.image_rows, np.ascontiguousarray(self.image_features, dtype=np.float32).view(np.int32)]
        if flags & _EXTENT:
            arrays.append(self.extent)
        return arrays + [array for arrays in states for array in arrays]

    @property
    def _flags(self) -> int:
        spans = any(group.image_spans is not None for group in self.groups)
        return ((_SPANS * spans) | (_ROPE * (self.rope_positions is not None))
                | (_FEATURES * (self.image_rows is not None)) | (_EXTENT * (self.extent is not None)))

    @classmethod
    def from_arrays(cls, arrays: list[np.ndarray], pools: tuple[StatePool, ...]) -> StepInputs:
        """`pools`: the runner's state pools, each reading its own inputs back."""
        num_page_groups = arrays[2].shape[0]
        num_groups, flags, *num_state_arrays = (int(n) for n in arrays[4])
        fields, start = 3 + 2 * num_page_groups, 5
        groups = [GroupInputs(*arrays[i:i + 3], tuple(arrays[i + 3:i + 3 + num_page_groups]),
                              tuple(arrays[i + 3 + num_page_groups:i + fields]))
                  for i in range(start, start + num_groups * fields, fields)]
        start += num_groups * fields
        if flags & _SPANS:
            groups = [group._replace(image_spans=spans) for group, spans in zip(groups, arrays[start:])]
            start += num_groups
        images: dict[str, np.ndarray] = {}
        if flags & _ROPE:
            images["rope_positions"], start = arrays[start], start + 1
        if flags & _FEATURES:
            rows, features = arrays[start:start + 2]
            images.update(image_rows=rows, image_features=features.view(np.float32))
            start += 2
        extent = None
        if flags & _EXTENT:
            extent, start = arrays[start], start + 1
        states = []
        for pool, count in zip(pools, num_state_arrays, strict=True):
            states.append(pool.inputs_from_arrays(arrays[start:start + count]))
            start += count
        return cls(*arrays[:4], tuple(groups), tuple(states), **images, extent=extent)


_SPANS, _ROPE, _FEATURES, _EXTENT = 1, 2, 4, 8  # StepInputs' flags: which optional arrays a step broadcast carries
