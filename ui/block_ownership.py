"""Which session holds each KV block: the data behind the block map."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tinymlx.core.outputs import EngineStats


@dataclass(frozen=True)
class BlockMapData:
    num_blocks: int
    owners: Mapping[int, tuple[int, ...]]  # block id -> the sessions referencing it (several: shared)
    cached: frozenset[int]


def block_map_data(stats: EngineStats, session_of: Callable[[str], int | None]) -> BlockMapData:
    """Owners from each live request's block tables (-1: a request of no session); cached from the engine.
    The KV groups' pools are laid end to end, in group order: group g's block b is cell offset_g + b."""
    offsets = [0]
    for group in stats.kv_groups:
        offsets.append(offsets[-1] + group.num_blocks)
    owners: dict[int, list[int]] = {}
    for request in stats.requests:
        session = session_of(request.request_id)
        for offset, table in zip(offsets, request.block_tables):
            for block_id in table:
                owners.setdefault(offset + block_id, []).append(-1 if session is None else session)
    cached = frozenset(offset + block_id for offset, group in zip(offsets, stats.kv_groups)
                       for block_id in group.cached_block_ids)
    return BlockMapData(stats.num_blocks_total, {b: tuple(s) for b, s in owners.items()}, cached)
