"""ModelRunner: ScheduledBatch -> StepInputs (host arrays) -> one forward -> logits. Owns the paged KV pool
and the state pools beside it.

The step is prepared on the host as plain integer arrays (`StepInputs`) before any MLX work, so a
tensor-parallel rank 0 can send exactly those arrays to the other ranks, which run the same
`forward` on their shard of the model and their slice of the KV pool.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from tinymlx.core.batch import ScheduledBatch, ScheduledChunk
from tinymlx.core.config import EngineConfig, kv_piece_shape_of
from tinymlx.core.layer_specs import LayerSpec, block_costs, page_groups
from tinymlx.core.step_memory import QUERY_TILE
from tinymlx.kv.coordinator import KVCoordinator
from tinymlx.kv.kv_cache import (
    AttentionGroup,
    PagedAttention,
    PagedAttentionMetadata,
    PagedKVCache,
    pieces_of_layers,
)
from tinymlx.kv.padded_pieces import padded_steps, unpad_index
from tinymlx.kv.pool_writes import PageWrite, PoolWrite
from tinymlx.kv.state_pool import state_pools
from tinymlx.models import (
    CausalLM,
    HeadInput,
    ImageRows,
    SlidingWindow,
    activation_dtype,
    kv_groups,
)
from tinymlx.ops import kernels
from tinymlx.ops.attention import first_visible_key, visible_keys
from tinymlx.ops.portable import NO_STEP_THREADS
from tinymlx.runner.step_inputs import GroupInputs, StepInputs
from tinymlx.vision.encoder_cache import EncoderCache, ImagePiece

# The shapes every tensor-parallel rank must agree on before the first step.
FINGERPRINT_FIELDS = ("layers", "hidden", "vocab", "local_kv_heads", "head_dim", "page_groups", "pool_pages",
                      "block_size", "kv_bytes_per_token_head", "query_tile", "state_slots", "state_floats_per_slot")


class ModelRunner:
    def __init__(self, model: CausalLM, config: EngineConfig, query_tile: int = QUERY_TILE, keeps_hidden: bool = False,
                 page_limit: Callable[[], int] | None = None):
        """`keeps_hidden`: every row's final hidden state of the last forward stays readable (`last_hidden`,
        `last_row_of`) for an MTP head to draft from; the last layer then runs every row. `page_limit`: a
        draft's pool, whose batches carry no extent, reads the pages it may hold from the target's pool."""
        assert config.is_resolved, "resolve the config against the model first"
        self.model, self.block_size, self.query_tile = model, config.block_size, query_tile
        self.keeps_hidden, self.page_limit = keeps_hidden, page_limit
        self.last_hidden: mx.array | None = None  # [N, hidden] in the flat order of the last forward
        self.last_row_of: dict[tuple[int, int], int] = {}
        # Layers of one kind of state form a KV group (the KV coordinator's); each run of its layers reads
        # the shared pool's pages through page tables of its own (a page group: core/layer_specs.py), and a
        # group's window shapes what its sequences gather and its attention mask.
        self.layer_specs = model.layer_specs()
        self.kv_groups = kv_groups(self.layer_specs)
        model_shape = (model.args.num_key_value_heads, model.args.head_dim)
        self.kv_group_costs = block_costs(self.kv_groups, model_shape)  # pages one block of each group takes
        self.kv_group_windows = tuple(_window(spec) for spec, _ in self.kv_groups)
        self.page_groups = page_groups(self.layer_specs, model_shape)
        self.windows = tuple(_window(spec) for spec, _ in self.page_groups)  # per page group
        # Masks are the same for a group's runs: made once per KV group, from its first page group.
        self._mask_of_page_group = tuple(g for g, cost in enumerate(self.kv_group_costs) for _ in range(cost))
        # KV groups whose image tokens attend to their whole image (Gemma): their masks read image spans.
        self._sees_whole_images = tuple(model.attends_whole_images(spec) for spec, _ in self.kv_groups)
        piece_heads, piece_dim = kv_piece_shape_of(model.args, self.layer_specs)
        # A pipeline stage keeps the K/V and states of its own layers; its page tables are every stage's.
        held = model.stage.layers
        pieces = tuple(p if layer in held else None
                       for layer, p in enumerate(pieces_of_layers(self.layer_specs, model_shape, piece_dim)))
        self.kv_cache = PagedKVCache(
            pieces, config.num_pages, config.block_size,
            piece_heads // model.tensor_parallel_size,
            config.kv_layout(model.args, activation_dtype(model), self.layer_specs),
        )
        # The pools of the layers' other kinds of state, in slots the KV coordinator hands out (kv/state_pool.py).
        self.state_pools = state_pools(self.layer_specs, config, held)
        # Their checkpoints' first slots are pages of the KV pool (kv/block_pool.py's region): not the KV arrays'.
        self.kv_cache.ensure_pages(0, limit=config.num_kv_pages_at_start)
        # What the kernels do between steps (the CPU's: BLAS threads that follow the cores others leave free); a
        # parallel rank's threads stay at its share of the machine's cores (parallel/launch.py).
        is_alone = model.tensor_parallel_size == 1 and model.stage.holds_everything
        self.step_threads = kernels.chosen().step_threads() if is_alone else NO_STEP_THREADS
        self._staged_writes: list[PoolWrite] = []  # written by the next step, before its forward (stage_writes)
        # A vision-language model's image features, by image (vision/encoder_cache.py).
        self.encoder_cache = EncoderCache(model.encode_images, config.image_cache_bytes) if model.sees_images else None

    def release(self) -> None:
        """Drop the weights and give the pools back (Engine.close): this runner runs nothing more."""
        self.model = None
        self.step_threads.restore()
        self.kv_cache.release()
        if self.encoder_cache is not None:
            self.encoder_cache.clear()
        for pool in self.state_pools:
            pool.release()

    def run(self, batch: ScheduledBatch) -> mx.array:
        """Logits [num_sampled_chunks, vocab] for the last token of each chunk that samples.

        Every chunk of the batch goes through one forward; tokens are laid out flat, group by
        group, so the linear layers never see padding.
        """
        return self.logits(self.prepare(batch))

    def start(self, batch: ScheduledBatch, pending: mx.array | None = None) -> mx.array:
        """`run` without waiting for it: the forward is under way on the device when this returns, and the
        logits are read when the caller evaluates what it builds on them. `pending`: the tokens the step
        before sampled, still on the device; a chunk with `pending_row` i (a placeholder: see
        Scheduler.commit_ahead) takes `pending[i]` as its last token."""
        inputs = self.prepare(batch)
        logits = self.step_logits(inputs, pending)
        mx.async_eval(logits, self._pools)
        return logits

    def run_with_context(self, batch: ScheduledBatch, context: HeadInput) -> tuple[mx.array, mx.array]:
        """A head model's step (models/mtp.py): (logits, hidden states) of the rows that sample, given
        `context.hidden` [N, hidden] in the batch's order of chunks and tokens."""
        inputs = self.prepare(batch)
        in_batch = {(c.seq_id, c.start_position + i): row for row, (c, i) in
                    enumerate((c, i) for c in batch.chunks for i in range(c.num_tokens))}
        order = np.empty(len(in_batch), dtype=np.int32)
        for key, flat_row in inputs.row_of.items():
            order[flat_row] = in_batch[key]
        hidden = self.forward(inputs, context=context._replace(hidden=context.hidden[mx.array(order)]))
        logits = self._sampled_logits(hidden, inputs)
        mx.eval(logits, hidden, self._pools)
        return logits, hidden

    def logits(self, inputs: StepInputs, eval_hidden: bool = False, hidden: mx.array | None = None) -> mx.array:
        """The step's logits, evaluated. `eval_hidden`: every row's hidden states too, so that a tensor-parallel
        rank runs every collective of the forward even when nothing samples (its peers do). `hidden`: the stage
        before's, on a pipeline's last stage."""
        if eval_hidden:
            hidden = self.forward(inputs, hidden=hidden)
            logits = self._sampled_logits(hidden, inputs)
            mx.eval(logits, hidden, self._pools)
            return logits
        logits = self.step_logits(inputs, hidden=hidden)
        mx.eval(logits, self._pools)
        return logits

    def step_logits(self, inputs: StepInputs, pending: mx.array | None = None, hidden: mx.array | None = None) -> mx.array:
        """The logits of the rows that sample; the kernels' threads adapt first (step_threads). `hidden`: the
        stage before's, on a pipeline's last stage."""
        self.step_threads.adapt()
        return self._sampled_logits(self.forward(inputs, pending, hidden=hidden), inputs)

    @property
    def pools_bytes_budget(self) -> int:
        """What the pools may grow to: every page of the KV pool (a pipeline stage's layers' share of each), and
        the state slots held now."""
        return (self.kv_cache.num_pages * self.kv_cache.page_nbytes
                + sum(4 * pool.num_slots * pool.floats_per_slot for pool in self.state_pools))

    @property
    def _pools(self) -> list[mx.array]:
        """Every array a step writes in place: K/V pools and state pools."""
        return [*self.kv_cache.arrays, *(array for pool in self.state_pools for array in pool.arrays)]

    def _sampled_logits(self, hidden: mx.array, inputs: StepInputs) -> mx.array:
        if not inputs.sample_index.size:  # no all-gather of nothing: every rank skips it alike
            return mx.zeros((0, self.model.args.vocab_size), dtype=hidden.dtype)
        return self.model.logits(hidden)

    def execute(self, inputs: StepInputs, hidden: mx.array | None = None) -> None:
        """A worker rank's step: the same forward and its slice of the logits, which only rank 0 keeps. `hidden`: on
        a pipeline's last stage, the stage before's."""
        hidden = self.forward(inputs, hidden=hidden)
        mx.eval(self._sampled_logits(hidden, inputs), hidden, self._pools)

    def run_stage(self, inputs: StepInputs, hidden: mx.array | None) -> mx.array:
        """A pipeline stage before the last: every row's hidden states, from `hidden` (the stage before's; the
        first stage's from the tokens), evaluated with the step's writes to this stage's pools."""
        self.step_threads.adapt()
        hidden = self.forward(inputs, hidden=hidden)
        mx.eval(hidden, self._pools)
        return hidden

    def fingerprint(self) -> list[int]:
        """The values of FINGERPRINT_FIELDS."""
        args, cache = self.model.args, self.kv_cache
        return [args.num_hidden_layers, args.hidden_size, args.vocab_size, self.model.num_local_kv_heads,
                args.head_dim, len(self.page_groups), cache.num_pages, cache.block_size,
                cache.layout.bytes_per_token_head, self.query_tile, sum(pool.num_slots for pool in self.state_pools),
                sum(pool.floats_per_slot for pool in self.state_pools)]

    def inputs_from_arrays(self, arrays: list[np.ndarray]) -> StepInputs:
        """A step broadcast's inputs (StepInputs.to_arrays), on a worker rank."""
        return StepInputs.from_arrays(arrays, self.state_pools)

    # -- host side: ScheduledBatch -> StepInputs ---------------------------------------------------
    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        groups = self._attention_groups(batch.chunks)
        ordered = [piece for group in groups for piece in group]
        # A pending token (a chunk's `pending_row`) holds 0 in `tokens` until the forward takes its draw.
        tokens = np.fromiter((t for c in ordered for t in (*c.token_ids, *[0] * (c.pending_row is not None))),
                             dtype=np.int32)
        piece_positions = [np.arange(c.start_position, c.start_position + c.num_tokens) for c in ordered]
        slots = np.stack([np.concatenate([self._slots(c.block_tables[g], p) for c, p in zip(ordered, piece_positions)])
                          for g in range(len(self.page_groups))])

        group_inputs, offset = [], 0
        for group in groups:
            group_inputs.append(self._group(group, offset))
            offset += sum(c.num_tokens for c in group)

        # The row of every (sequence, position) in the flat batch (groups may reorder a chunk's
        # pieces), then the rows that sample: a chunk's last token, or a verified chunk's last 1 + k.
        row_of: dict[tuple[int, int], int] = {}
        pending_rows = []
        for piece, end in zip(ordered, np.cumsum([c.num_tokens for c in ordered])):
            start = int(end) - piece.num_tokens
            row_of.update(((piece.seq_id, piece.start_position + i), start + i) for i in range(piece.num_tokens))
            if piece.pending_row is not None:
                pending_rows.append((int(end) - 1, piece.pending_row))
        sample_index = [row_of[c.seq_id, position] for c in batch.chunks if c.needs_sample
                        for position in range(c.start_position + c.num_tokens - c.num_logits,
                                              c.start_position + c.num_tokens)]
        states = tuple(pool.step_inputs(batch.chunks, row_of) for pool in self.state_pools)
        return StepInputs(tokens, np.concatenate(piece_positions).astype(np.int32), slots.astype(np.int32),
                          np.array(sample_index, dtype=np.int32), tuple(group_inputs), states, row_of,
                          *self._image_inputs(ordered),
                          pending_rows=np.array(pending_rows, dtype=np.int32) if pending_rows else None,
                          extent=None if batch.extent is None else np.array([batch.extent.kv_pages, *batch.extent.state_slots],
                                                                            dtype=np.int32))

    def with_image_features(self, inputs: StepInputs) -> StepInputs:
        """The step's image features read into host memory, for the step broadcast (parallel/)."""
        if inputs.image_rows is None:
            return inputs
        features = self.encoder_cache.rows(list(inputs.image_pieces)).astype(mx.float32)
        return inputs._replace(image_features=np.array(features))

    def _image_inputs(self, ordered: list[ScheduledChunk]) -> tuple[np.ndarray | None, np.ndarray | None,
                                                                     tuple[ImagePiece, ...]]:
        """(M-RoPE positions, image rows, image pieces) of a step whose chunks belong to prompts with images:
        every token of the step gets its three positions (a text prompt's are its position, thrice), and
        each image token its row, whichever chunk of its image's span the step computes."""
        if all(c.images is None for c in ordered):
            return None, None, ()
        rope, rows, pieces, row = [], [], [], 0
        for chunk in ordered:
            start, end = chunk.start_position, chunk.start_position + chunk.num_tokens
            images = chunk.images
            if self.model.has_multimodal_rope:  # Gemma's positions stay plain: nothing to build
                placed = images is not None and images.rope_positions is not None
                rope.append(images.rope(start, end) if placed else np.broadcast_to(np.arange(start, end), (3, end - start)))
            for span, first, last in images.overlapping(start, end) if images is not None else ():
                at = row + span.start + first - start
                rows.append(np.arange(at, at + last - first))
                pieces.append((span.image, first, last))
            row += end - start
        rope_positions = np.concatenate(rope, axis=1).astype(np.int32) if rope else None
        image_rows = np.concatenate(rows).astype(np.int32) if rows else None
        return rope_positions, image_rows, tuple(pieces)

    def _attention_groups(self, chunks: list[ScheduledChunk]) -> list[list[ScheduledChunk]]:
        """Split prefill chunks into query tiles and group the pieces by how far back they read.

        Attention pads each group to [pieces, longest piece, longest context]. A whole prompt
        padded that way computes every query against every key, masked half included; as tiles
        of at most `query_tile` tokens, each reads only the blocks up to its own last token. A chunk's
        tiles differ in length by at most one (85 tokens: 42 + 43, not 64 + 21, which its group would
        pad to 64 + 64). Grouping by reach (contexts within a power of two) keeps the context padding
        small, and single-token pieces (decodes) never share a group with tiles, whose length they would
        be padded to. All K/V of the step are written before any attention, so tiles of one chunk see
        each other. A chunk's tiles that land in one group are joined again where that pads no more
        scores (`_joined`).
        """
        groups: dict[tuple[bool, int], list[tuple[ScheduledChunk, int, int]]] = {}
        for chunk in chunks:
            num_tiles = -(-chunk.num_tokens // self.query_tile)
            ends = [chunk.num_tokens * (i + 1) // num_tiles for i in range(num_tiles)]
            for start, end in zip([0, *ends], ends):
                reach = (self._blocks_read(chunk.piece(start, end)) - 1).bit_length()
                groups.setdefault((end - start > 1, reach), []).append((chunk, start, end))
        return [[chunk.piece(start, end) for chunk, start, end in _joined(groups[key])] for key in sorted(groups)]

    def _blocks_read(self, chunk: ScheduledChunk) -> int:
        """Blocks up to the chunk's last token, or the end of the image it ends in where images attend both
        ways: all its queries may see."""
        last = chunk.start_position + chunk.num_tokens - 1
        if chunk.images is not None and any(self._sees_whole_images):
            last = max(last, int(chunk.images.whole_span_bounds(np.array(last))[1]) - 1)
        return last // self.block_size + 1

    def _slots(self, table: tuple[int, ...], positions: np.ndarray) -> np.ndarray:
        blocks = np.asarray(table, dtype=np.int64)[positions // self.block_size]
        assert (blocks >= 0).all(), "a new token's K/V would land in a released block"
        return blocks * self.block_size + positions % self.block_size

    def _group(self, chunks: list[ScheduledChunk], offset: int) -> GroupInputs:
        lengths = np.array([c.num_tokens for c in chunks], dtype=np.int32)
        # Padding queries repeat the chunk's last token: valid to compute, dropped after attention.
        steps = padded_steps(lengths)
        starts = offset + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        positions = np.array([c.start_position for c in chunks])[:, None] + steps
        # Read only the blocks up to each chunk's last token (a long prompt's first chunk must not pay
        # for the blocks reserved for its later chunks) and, in a sliding group, from the first block
        # its first query's window reaches.
        end_blocks = [self._blocks_read(c) for c in chunks]
        tables, first_keys = [], []
        for g, window in enumerate(self.windows):
            first_blocks = [first_visible_key(c.start_position, window) // self.block_size for c in chunks]
            table = np.zeros((len(chunks), max(e - f for e, f in zip(end_blocks, first_blocks))), dtype=np.int32)
            for row, (chunk, first, end) in enumerate(zip(chunks, first_blocks, end_blocks)):
                table[row, :end - first] = chunk.block_tables[g][first:end]
            tables.append(table)
            first_keys.append(np.array(first_blocks, dtype=np.int32) * self.block_size)
        spans = None
        if any(self._sees_whole_images) and any(c.images is not None for c in chunks):
            spans = np.stack([c.images.whole_span_bounds(p) if c.images is not None else np.full((*p.shape, 2), -1)
                              for c, p in zip(chunks, positions)]).astype(np.int32)
        return GroupInputs((starts[:, None] + steps).astype(np.int32), positions.astype(np.int32), lengths,
                           tuple(tables), tuple(first_keys), spans)

    # -- device side: StepInputs -> hidden states --------------------------------------------------
    def forward(self, inputs: StepInputs, pending: mx.array | None = None, context: HeadInput | None = None,
                hidden: mx.array | None = None) -> mx.array:
        """Hidden states [S, hidden] of the rows that sample (`sample_index`; all when none does); every
        token's K/V lands in the pool on the way. `pending`: the draws pending tokens take (`start`);
        `context`: a head model's input beside the tokens, in the flat order. A pipeline stage after the first
        starts from `hidden` [N, hidden], the stage before's; one before the last returns every row's."""
        self._ready_pools(inputs)
        groups = tuple(self._attention_group(group) for group in inputs.groups)
        metadata = PagedAttentionMetadata(mx.array(inputs.slot_mapping), groups)
        states = tuple(pool.step(step) for pool, step in zip(self.state_pools, inputs.states, strict=True))
        attention = PagedAttention(self.kv_cache, metadata, states)
        # Nothing samples: every row, since MLX's quantized matmul of zero rows dies of SIGFPE (0.32.4), and
        # only a tensor-parallel step evaluates the hidden state then.
        rows = mx.array(inputs.sample_index) if inputs.sample_index.size else None
        tokens = mx.array(inputs.tokens)
        if inputs.pending_rows is not None:  # placeholders: these rows take the previous step's draws, on the device
            assert pending is not None, "a chunk takes a pending token, but no step is in flight"
            rows_taking, draws = inputs.pending_rows.T
            tokens[mx.array(rows_taking)] = pending[mx.array(draws)].astype(tokens.dtype)
        positions = mx.array(inputs.positions if inputs.rope_positions is None else inputs.rope_positions)
        if hidden is not None:
            return self.model(tokens, positions, attention, rows, hidden=hidden)
        if context is not None:
            return self.model(tokens, positions, attention, rows, context)
        if inputs.image_rows is not None:
            features = (mx.array(inputs.image_features) if inputs.image_features is not None
                        else self.encoder_cache.rows(list(inputs.image_pieces)))
            return self.model(tokens, positions, attention, rows, images=ImageRows(features, mx.array(inputs.image_rows)))
        if not self.keeps_hidden:
            return self.model(tokens, positions, attention, rows)
        self.last_hidden, self.last_row_of = self.model(tokens, positions, attention), inputs.row_of
        return self.last_hidden if rows is None else self.last_hidden[rows]

    def _ready_pools(self, inputs: StepInputs) -> None:
        """Size the pools' arrays for the step (every rank alike: they see the same inputs): the KV arrays hold
        the highest page the step writes or reads, within the extent's pages (shrunk first where the state slots'
        region grew into them), and the state pools the extent's slots. Then make the writes staged for this
        step (the disk tier's restores)."""
        reached = [int(inputs.slot_mapping.max(initial=-1)) // self.block_size]
        reached += [int(table.max(initial=-1)) for group in inputs.groups for table in group.block_tables]
        if inputs.extent is not None:
            kv_pages, *state_slots = (int(n) for n in inputs.extent)
            self.kv_cache.ensure_pages(max(reached) + 1, limit=kv_pages)  # first: the KV arrays may shrink
            for pool, num_slots in zip(self.state_pools, state_slots, strict=True):
                pool.fit(num_slots)
        else:
            self.kv_cache.ensure_pages(max(reached) + 1, limit=self.page_limit() if self.page_limit else None)
        writes, self._staged_writes = self._staged_writes, []
        for write in writes:
            if isinstance(write, PageWrite):
                self.kv_cache.write_blocks(write.place, write.pages, write.arrays)
            else:
                self.state_pools[write.pool].write_slot(write.slot, write.arrays)

    def stage_writes(self, writes: list[PoolWrite]) -> None:
        """Writes the next step makes into the pools before anything reads them (the disk tier's restores): the
        pools' arrays have one writer, the step."""
        self._staged_writes += writes

    def shrink_pools(self, num_pages_reached: int) -> None:
        """Give back the pool's pages from `num_pages_reached` on (no page there is taken)."""
        self.kv_cache.shrink(num_pages_reached)
        mx.clear_cache()  # MLX keeps freed buffers for reuse; hand them back to the system

    def _attention_group(self, group: GroupInputs) -> AttentionGroup:
        # One mask per KV group and step, shared by the group's layers: a query sees the keys up to its own
        # position, and a window's only its last W (slot i of a gathered context holds first key + i).
        positions = mx.array(group.positions)
        spans = None if group.image_spans is None else mx.array(group.image_spans)
        masks: dict[int, mx.array] = {}
        for g, (table, first_key, window) in enumerate(zip(group.block_tables, group.first_key_positions, self.windows)):
            kv_group = self._mask_of_page_group[g]
            if kv_group not in masks:
                keys = mx.array(first_key)[:, None] + mx.arange(table.shape[1] * self.block_size)[None, :]
                masks[kv_group] = visible_keys(positions, keys, window,  # [B, L, context]
                                               spans if self._sees_whole_images[kv_group] else None)
        visible = tuple(masks[kv_group] for kv_group in self._mask_of_page_group)
        return AttentionGroup(mx.array(group.token_index), visible,
                              tuple(mx.array(table) for table in group.block_tables), unpad_index(group.lengths))


def _window(spec: LayerSpec) -> int | None:
    return spec.window if isinstance(spec, SlidingWindow) else None


class PoolShrink:
    """With no request left, the pool's arrays past the last page held or cached go back to the system
    (an idle hook of the step: engine/stages.py)."""

    def __init__(self, runner: ModelRunner, kv_coordinator: KVCoordinator):
        self.runner, self.kv_coordinator = runner, kv_coordinator

    def idle(self) -> None:
        self.runner.shrink_pools(self.kv_coordinator.pool.num_pages_reached)


def _joined(tiles: list[tuple[ScheduledChunk, int, int]]) -> list[tuple[ScheduledChunk, int, int]]:
    """A group's tiles, or each chunk's tiles in it joined into one piece where that pads the group to no more
    scores ([pieces, longest piece] against the same longest context): its context is then gathered once,
    not once a tile. That is a long prompt's chunk far into its context, whose tiles all reach alike."""
    joined: dict[int, tuple[ScheduledChunk, int, int]] = {}
    for chunk, start, end in tiles:  # a chunk's tiles in one group are consecutive
        first = joined.get(id(chunk), (chunk, start, end))[1]
        joined[id(chunk)] = (chunk, first, end)

    def padded(pieces) -> int:
        return len(pieces) * max(end - start for _, start, end in pieces)

    return list(joined.values()) if padded(joined.values()) <= padded(tiles) else tiles
