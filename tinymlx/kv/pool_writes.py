"""Writes into the pools' arrays that no forward computes (the disk tier's restores), as plain data. The
runner's step makes them, before anything of the step reads the pools: the arrays have one writer."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class PageWrite(NamedTuple):
    """Blocks of K/V into pages of one place of a run of layers (kv_cache.py `write_blocks`)."""

    place: int
    pages: list[int]
    arrays: list[np.ndarray]  # as kv_cache.read_blocks gives them


class SlotWrite(NamedTuple):
    """A whole state into a slot of one of the runner's state pools (state_pool.py `write_slot`)."""

    pool: int  # its index among the runner's state pools
    slot: int
    arrays: list[np.ndarray]  # as the pool's read_slots gives them


PoolWrite = PageWrite | SlotWrite
