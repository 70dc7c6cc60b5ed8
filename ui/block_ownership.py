"""Which session holds each KV block: the data behind the block map."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from tinymlx.core.outputs import EngineStats


@dataclass(frozen=True)
class BlockMapData:
    num_pages: int
    owners: Mapping[int, tuple[int, ...]]  # block id -> the sessions referencing it (several: shared)
    cached: frozenset[int]
    num_state_pages: int = 0  # a hybrid's recurrent checkpoints: the pool's last pages (kv/block_pool.py)


def block_map_data(stats: EngineStats, session_of: Callable[[str], int | None]) -> BlockMapData:
    """Owners from each live request's page tables (-1: a request of no session); cached from the engine.
    A cell is a page of the shared pool: every KV group's blocks take theirs from it."""
    owners: dict[int, list[int]] = {}
    for request in stats.requests:
        session = session_of(request.request_id)
        for table in request.block_tables:
            for page in table:
                owners.setdefault(page, []).append(-1 if session is None else session)
    cached = frozenset(page for group in stats.kv_groups for page in group.cached_pages)
    return BlockMapData(stats.num_pages_total, {b: tuple(s) for b, s in owners.items()}, cached, stats.num_pages_states)
