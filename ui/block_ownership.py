"""Which session holds each KV block: the data behind the block map."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tinymlx.outputs import EngineStats


@dataclass(frozen=True)
class BlockMapData:
    num_blocks: int
    owners: Mapping[int, tuple[int, ...]]  # block id -> the sessions referencing it (several: shared)
    cached: frozenset[int]


def block_map_data(stats: EngineStats, session_of: Callable[[str], int | None]) -> BlockMapData:
    """Owners from each live request's block table (-1: a request of no session); cached from the engine."""
    owners: dict[int, list[int]] = {}
    for request in stats.requests:
        session = session_of(request.request_id)
        for block_id in request.block_table:
            owners.setdefault(block_id, []).append(-1 if session is None else session)
    return BlockMapData(stats.num_blocks_total, {b: tuple(s) for b, s in owners.items()},
                        frozenset(stats.cached_block_ids))
