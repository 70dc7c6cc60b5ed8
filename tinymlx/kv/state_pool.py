"""The device side of a kind of per-sequence layer state kept beside the paged KV pool: one interface, so
the runner, the tensor-parallel broadcast and the disk tier use every kind's pool without knowing it.

A pool's states live in slots that the KV coordinator hands out (a chunk's `state`: core/batch.StateAccess,
the same slot numbers in every pool). A step runs through it in three parts, each plain data to the next:

    step_inputs(chunks, row_of)  host arrays, identical on every rank (`to_arrays` / `inputs_from_arrays`)
    step(inputs)                 the step's view of the pool: the backend calls its layers make, by name
    read_slots / write_slot      host copies of whole states, which the disk tier saves and restores
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import mlx.core as mx
import numpy as np

from tinymlx.core.batch import ScheduledChunk
from tinymlx.core.config import EngineConfig
from tinymlx.core.layer_specs import LayerSpec
from tinymlx.kv.state_cache import RecurrentStateCache

SlotArray = tuple[tuple[int, ...], str]  # (shape, NumPy dtype) of one array of a slot's state


class StateInputs(Protocol):
    def to_arrays(self) -> list[np.ndarray]:
        """Flat int32 arrays for the tensor-parallel step broadcast (StatePool.inputs_from_arrays reads them)."""


class StateStep(Protocol):
    # The AttentionBackend methods its layers call, by name (recurrent layers: conv1d, delta_rule).
    backend_calls: dict[str, Callable[..., mx.array]]


class StatePool(Protocol):
    num_slots: int
    num_layers: int  # layers that keep this kind of state
    floats_per_slot: int  # one slot's values over every layer (tensor-parallel ranks agree on it)
    disk_name: str  # what its checkpoint files' names add to the model's fingerprint: never a block's name
    layout: str  # its state's layout in words (checkpoint files and the model's fingerprint carry it)
    slot_arrays: tuple[SlotArray, ...]  # one slot's state as read_slots gives it

    @property
    def arrays(self) -> list[mx.array]:
        """Every array a step writes in place."""

    @property
    def nbytes(self) -> int: ...

    def step_inputs(self, chunks: list[ScheduledChunk], row_of: dict[tuple[int, int], int]) -> StateInputs:
        """The step's chunks as this pool computes them (`row_of`: each (sequence, position)'s flat row)."""

    def inputs_from_arrays(self, arrays: list[np.ndarray]) -> StateInputs: ...

    def step(self, inputs: StateInputs) -> StateStep: ...

    def read_slots(self, slots: list[int]) -> list[list[np.ndarray]]:
        """Host copies of the states in `slots`, each as `slot_arrays`."""

    def write_slot(self, slot: int, arrays: list[np.ndarray]) -> None:
        """Store a state read by `read_slots` into `slot` (before the step's forward)."""

    def fit(self, num_slots: int) -> None:
        """Hold `num_slots` slots, as a step's extent says (core/batch.py PoolExtent)."""

    def release(self) -> None:
        """Give every array back (the engine is closing)."""


def state_pools(specs: tuple[LayerSpec, ...], config: EngineConfig, held: range | None = None) -> tuple[StatePool, ...]:
    """The pools a model's layers need beside the KV pool, one per kind of state: none for a model whose
    layers all keep K/V. `held`: a pipeline stage's layers, whose states alone its pools keep."""
    return RecurrentStateCache.for_model(specs, config, held)
