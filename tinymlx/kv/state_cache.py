"""Recurrent state slots on the device, and how a step reads and writes them: the recurrent layers' state
pool (kv/state_pool.py).

Each recurrent layer owns two pools of `num_slots` states (float32):

    conv[layer]   [slots, K-1, conv_dim]       the last K-1 inputs of its causal convolution
    delta[layer]  [slots, heads, Dk, Dv]       its delta-rule state
    slot 0        always zero: a sequence that starts from nothing reads it (never written)
    slots 1..     live states (one per running sequence) and checkpoints (StateSlots hands them out)

The arrays hold the fixed slots and as many checkpoint slots as the KV pool's region holds now
(kv/block_pool.py): a step's extent sizes them (`fit`), growing as the region grows and shrinking as the
KV groups take its pages back.

A step's recurrent layers see its sequences as whole chunks (never query tiles) padded to [B, L] (decodes
together, L = 1; verified chunks together; prefill chunks together). Each piece reads the state it starts
from (its live slot, or the checkpoint or zero slot it resumes from), runs its tokens through, and writes the state after them to its live slot and,
where the scheduler asked, the state after its first `offset` tokens to a checkpoint slot: one gather
per pool and layer, and one in-place slice update per slot written (MLX's CPU scatter moves one element
at a time: writing 16 states of 1 MiB took 39 ms as a scatter, 4.5 ms as 16 slice updates).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from tinymlx.core.batch import ScheduledChunk
from tinymlx.core.config import EngineConfig
from tinymlx.core.layer_specs import LayerSpec, Recurrent, recurrent_layers
from tinymlx.kv.padded_pieces import padded_steps, unpad_index, unpadded
from tinymlx.kv.zero_pages import zeros
from tinymlx.models import gated_delta

# One padded group of pieces as host arrays: token_index [B, L] (each token's flat row), lengths [B], read
# slots [B], write slots [B], checkpoints ((row, tokens into the piece, slot), ...).
HostGroup = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, tuple[tuple[int, int, int], ...]]


class RecurrentInputs(NamedTuple):
    """The recurrent layers' view of a step as host arrays (RecurrentStateCache.step_inputs)."""

    groups: tuple[HostGroup, ...]
    order: np.ndarray | None  # [N] each flat row's place among the groups' real tokens (None: the same order)

    def to_arrays(self) -> list[np.ndarray]:
        """Each group's arrays (its checkpoints as [n, 3]), then the order where there is one."""
        arrays = [a for *indices, checkpoints in self.groups
                  for a in (*indices, np.array(checkpoints, dtype=np.int32).reshape(-1, 3))]
        return arrays if self.order is None else [*arrays, self.order]

    @classmethod
    def from_arrays(cls, arrays: list[np.ndarray]) -> RecurrentInputs:
        num_groups, has_order = divmod(len(arrays), 5)
        groups = tuple((*arrays[i:i + 4], tuple(tuple(int(v) for v in row) for row in arrays[i + 4]))
                       for i in range(0, 5 * num_groups, 5))
        return cls(groups, arrays[-1] if has_order else None)


class RecurrentGroup(NamedTuple):
    """Pieces padded to one length L; checkpoints are (row, tokens into the piece, slot) on the host."""

    token_index: mx.array  # [B, L] row of each token in the flat batch (padding repeats a real one)
    lengths: mx.array  # [B] real tokens of each piece
    read_slots: mx.array  # [B] the slot each piece's state starts from
    write_slots: tuple[int, ...]  # [B] the slot its state after the piece goes to
    checkpoints: tuple[tuple[int, int, int], ...]
    unpad_index: mx.array | None  # [n] rows of the flattened [B*L] output that are real tokens


class RecurrentMetadata(NamedTuple):
    groups: tuple[RecurrentGroup, ...]
    order: mx.array | None  # [N] each flat row's place among the groups' real outputs (None: in order)
    chunk_size: int  # the chunk-wise delta rule's chunk: it divides the block size, so block ends are chunk ends


class RecurrentStateCache:
    """The recurrent layers' state pool (a kv/state_pool.StatePool): `num_slots` states of each layer."""

    disk_name = "state"

    def __init__(self, layers: tuple[tuple[int, Recurrent], ...], num_slots: int, block_size: int):
        """`num_slots`: the slots held until a step's extent says otherwise."""
        self.num_slots, self.num_layers = num_slots, len(layers)
        self.floats_per_slot = sum(spec.num_state_floats for _, spec in layers)
        self.layout = "recurrent_state=float32 layers " + " ".join(
            f"{layer}:conv[{s.kernel - 1},{s.conv_dim}]+delta[{s.heads},{s.key_dim},{s.value_dim}]" for layer, s in layers)
        self.slot_arrays = tuple(array for _, s in layers for array in (((s.kernel - 1, s.conv_dim), "float32"),
                                                                         ((s.heads, s.key_dim, s.value_dim), "float32")))
        # The chunk-wise delta rule's chunk divides the block size: every block end is a chunk end.
        self.chunk_size = math.gcd(16, block_size)
        self.conv = {layer: zeros((num_slots, spec.kernel - 1, spec.conv_dim)) for layer, spec in layers}
        self.delta = {layer: zeros((num_slots, spec.heads, spec.key_dim, spec.value_dim)) for layer, spec in layers}
        mx.eval(self.arrays)

    @classmethod
    def for_model(cls, specs: tuple[LayerSpec, ...], config: EngineConfig,
                  held: range | None = None) -> tuple[RecurrentStateCache, ...]:
        """The pool of a model's recurrent layers, as many slots as the config sizes: none without any. `held`:
        the layers a pipeline stage runs, whose states alone it keeps (its pool may hold none: the step inputs
        stay those of every stage)."""
        layers = recurrent_layers(specs)
        num_slots = config.num_state_slots + config.num_initial_checkpoints
        here = tuple((layer, spec) for layer, spec in layers if held is None or layer in held)
        return (cls(here, num_slots, config.block_size),) if layers else ()

    def release(self) -> None:
        """Give every state back (the engine is closing)."""
        self.conv, self.delta = {}, {}

    def fit(self, num_slots: int) -> None:
        """Hold `num_slots` slots: the slots past them hold nothing (the region gave them back)."""
        if num_slots == self.num_slots:
            return
        for pools in (self.conv, self.delta):
            for layer, old in pools.items():
                if num_slots > old.shape[0]:
                    new = mx.concatenate([old, zeros((num_slots - old.shape[0], *old.shape[1:]), old.dtype)])
                else:
                    new = mx.contiguous(old[:num_slots])
                mx.eval(new)  # one layer at a time: the peak is the pool and one layer's new arrays
                pools[layer] = new
        self.num_slots = num_slots

    @property
    def arrays(self) -> list[mx.array]:
        return [*self.conv.values(), *self.delta.values()]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def read_slots(self, slots: list[int]) -> list[list[np.ndarray]]:
        """Host copies of the states in `slots` (the disk tier saves checkpoints): per slot, each layer's
        conv state then its delta-rule state. No reference to a pool is kept (see RecurrentStep)."""
        index = mx.array(slots)
        arrays = [pool[index] for layer in self.conv for pool in (self.conv[layer], self.delta[layer])]
        mx.eval(arrays)
        host = [np.array(a) for a in arrays]
        return [[a[i] for a in host] for i in range(len(slots))]

    def write_slot(self, slot: int, arrays: list[np.ndarray]) -> None:
        """Store a state of `read_slots`'s layout into `slot` (the disk tier's restore, before the forward)."""
        for layer, conv, delta in zip(self.conv, arrays[0::2], arrays[1::2]):
            _write(self.conv[layer], [(slot, mx.array(conv)[None])])
            _write(self.delta[layer], [(slot, mx.array(delta)[None])])

    # -- a step ---------------------------------------------------------------------------------
    def step_inputs(self, chunks: list[ScheduledChunk], row_of: dict[tuple[int, int], int]) -> RecurrentInputs:
        """Decodes in one group and verified chunks (a token and its drafts) in another (the token-by-token
        form), prefill chunks in a third (the chunk-wise form)."""
        groups, real_rows = [], []
        decodes = [c for c in chunks if c.num_tokens == 1]
        verified = [c for c in chunks if c.num_tokens > 1 and c.num_draft_tokens]
        prefills = [c for c in chunks if c.num_tokens > 1 and not c.num_draft_tokens]
        for members in (decodes, verified, prefills):
            if not members:
                continue
            lengths = np.array([c.num_tokens for c in members], dtype=np.int32)
            token_index = np.array([[row_of[c.seq_id, c.start_position + t] for t in row]
                                    for c, row in zip(members, padded_steps(lengths))], dtype=np.int32)
            real_rows += [token_index[b, :n] for b, n in enumerate(lengths)]
            assert all(c.state is not None for c in members), "a chunk of a recurrent model without its state slots"
            checkpoints = tuple((b, offset, slot) for b, c in enumerate(members) for offset, slot in c.state.checkpoints)
            groups.append((token_index, lengths, np.array([c.state.read_slot for c in members], dtype=np.int32),
                           np.array([c.state.write_slot for c in members], dtype=np.int32), checkpoints))
        rows = np.concatenate(real_rows)
        order = None
        if not (rows == np.arange(len(rows))).all():
            order = np.empty(len(rows), dtype=np.int32)
            order[rows] = np.arange(len(rows))
        return RecurrentInputs(tuple(groups), order)

    def inputs_from_arrays(self, arrays: list[np.ndarray]) -> RecurrentInputs:
        return RecurrentInputs.from_arrays(arrays)

    def step(self, inputs: RecurrentInputs) -> RecurrentStep:
        groups = tuple(RecurrentGroup(mx.array(token_index), mx.array(lengths), mx.array(read_slots),
                                      tuple(write_slots.tolist()), checkpoints, unpad_index(lengths))
                       for token_index, lengths, read_slots, write_slots, checkpoints in inputs.groups)
        order = None if inputs.order is None else mx.array(inputs.order)
        return RecurrentStep(self, RecurrentMetadata(groups, order, self.chunk_size))


class RecurrentStep:
    """The recurrent half of a step's backend (`backend_calls`: AttentionBackend.conv1d / delta_rule).

    Every state the step reads is gathered and evaluated up front: a pool whose pending gather is still in
    the graph cannot lend its buffer to the update that writes it, which then copies the whole pool
    (measured: 0.4 s for 256 slots of 1 MiB, against 5 ms in place).
    """

    def __init__(self, cache: RecurrentStateCache, metadata: RecurrentMetadata):
        self.cache, self.metadata = cache, metadata
        self._conv = {layer: [pool[g.read_slots] for g in metadata.groups] for layer, pool in cache.conv.items()}
        self._delta = {layer: [pool[g.read_slots] for g in metadata.groups] for layer, pool in cache.delta.items()}
        mx.eval(self._conv, self._delta)
        self.backend_calls = {"conv1d": self.conv1d, "delta_rule": self.delta_rule}

    def conv1d(self, layer: int, x: mx.array, weight: mx.array) -> mx.array:
        outputs, writes = [], []
        K1 = weight.shape[-1] - 1
        for group, state in zip(self.metadata.groups, self._conv.pop(layer)):
            out, inputs = gated_delta.causal_conv(x[group.token_index], state, weight)
            outputs.append(unpadded(out, group.unpad_index))
            # The K-1 inputs before token t of a piece are inputs[t : t + K-1] (the state, then the tokens).
            last = group.lengths[:, None] + mx.arange(K1)[None, :]
            after = mx.take_along_axis(inputs, last[..., None], axis=1).astype(mx.float32)
            writes += _writes(group, after, [inputs[row:row + 1, t:t + K1].astype(mx.float32)
                                             for row, t, _ in group.checkpoints])
        _write(self.cache.conv[layer], writes)
        return self._in_flat_order(outputs)

    def delta_rule(self, layer: int, q: mx.array, k: mx.array, v: mx.array, g: mx.array,
                   beta: mx.array) -> mx.array:
        outputs, writes = [], []
        for group, state in zip(self.metadata.groups, self._delta.pop(layer)):
            index = group.token_index
            g_group, beta_group = gated_delta.mask_padding(g[index], beta[index], group.lengths)
            keep = [(row, t) for row, t, _ in group.checkpoints]
            # Token by token: decodes, and verified chunks, whose states after every position are kept
            # (state_slots.py: snapshots); chunk-wise: prefill chunks, whose checkpoints end chunks.
            if index.shape[1] == 1 or any(t % self.metadata.chunk_size for _, t in keep):
                out, state, kept = gated_delta.recurrent(q[index], k[index], v[index], g_group, beta_group, state, keep)
            else:
                out, state, kept = gated_delta.chunked(q[index], k[index], v[index], g_group, beta_group, state,
                                                       self.metadata.chunk_size, keep)
            outputs.append(unpadded(out, group.unpad_index))
            writes += _writes(group, state, kept)
        _write(self.cache.delta[layer], writes)
        return self._in_flat_order(outputs)

    def _in_flat_order(self, outputs: list[mx.array]) -> mx.array:
        out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs)
        return out if self.metadata.order is None else out[self.metadata.order]


def _writes(group: RecurrentGroup, after: mx.array, kept: list[mx.array]) -> list[tuple[int, mx.array]]:
    """(slot, state [1, ...]) a group leaves: each piece's state after it [B, ...] to its live slot, and
    the states kept inside pieces to their checkpoints' slots."""
    return [*((slot, after[i:i + 1]) for i, slot in enumerate(group.write_slots)),
            *((slot, state) for (_, _, slot), state in zip(group.checkpoints, kept))]


def _write(pool: mx.array, writes: list[tuple[int, mx.array]]) -> None:
    """pool[slot] = state for each write, in place: the pool has one owner, so each slice update reuses
    its buffer (MLX's CPU scatter moves one element at a time: slices are 9x faster for 1 MiB states)."""
    for slot, state in writes:
        pool[slot:slot + 1] = state
