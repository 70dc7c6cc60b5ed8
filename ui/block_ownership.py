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
    The cells are the shared pool's blocks: each KV group's blocks in use or cached, in id order, group after
    group, each taking as many cells as the pool blocks it costs; the free ones follow."""
    holders: list[dict[int, list[int]]] = [{} for _ in stats.kv_groups]
    for request in stats.requests:
        session = session_of(request.request_id)
        for held, table in zip(holders, request.block_tables):
            for block_id in table:
                held.setdefault(block_id, []).append(-1 if session is None else session)
    owners: dict[int, tuple[int, ...]] = {}
    cached: set[int] = set()
    cursor = 0
    for group, held in zip(stats.kv_groups, holders):
        group_cached = set(group.cached_block_ids)
        for block_id in sorted(held.keys() | group_cached):
            cells = range(cursor, cursor + group.cost)
            if block_id in held:
                owners.update((c, tuple(held[block_id])) for c in cells)
            else:
                cached.update(cells)
            cursor += group.cost
    return BlockMapData(stats.num_blocks_total, owners, frozenset(cached))
