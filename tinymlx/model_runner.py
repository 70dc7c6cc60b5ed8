"""ModelRunner: ScheduledBatch -> mx arrays -> one forward -> logits. Owns the paged KV pool."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from tinymlx.batch import ScheduledBatch, ScheduledChunk
from tinymlx.config import EngineConfig
from tinymlx.kv_cache import AttentionGroup, PagedAttention, PagedAttentionMetadata, PagedKVCache
from tinymlx.models import activation_dtype
from tinymlx.models.qwen2 import Model


class ModelRunner:
    def __init__(self, model: Model, config: EngineConfig, query_tile: int = 64):
        assert config.is_resolved, "resolve the config against the model first"
        self.model, self.block_size, self.query_tile = model, config.block_size, query_tile
        args = model.args
        self.kv_cache = PagedKVCache(
            args.num_hidden_layers, config.num_blocks, config.block_size,
            args.num_key_value_heads, args.head_dim, activation_dtype(model),
        )
        self.scale = args.head_dim**-0.5

    def run(self, batch: ScheduledBatch) -> mx.array:
        """Logits [num_sampled_chunks, vocab] for the last token of each chunk that samples.

        Every chunk of the batch goes through one forward; tokens are laid out flat, group by
        group, so the linear layers never see padding.
        """
        groups = self._attention_groups(batch.chunks)
        ordered = [piece for group in groups for piece in group]
        tokens = np.fromiter((t for c in ordered for t in c.token_ids), dtype=np.int32)
        piece_positions = [np.arange(c.start_position, c.start_position + len(c.token_ids)) for c in ordered]
        positions = np.concatenate(piece_positions)
        slots = np.concatenate([self._slots(c, p) for c, p in zip(ordered, piece_positions)])

        attention_groups, offset = [], 0
        for group in groups:
            attention_groups.append(self._group(group, offset))
            offset += sum(len(c.token_ids) for c in group)
        metadata = PagedAttentionMetadata(mx.array(slots, dtype=mx.int32), tuple(attention_groups))

        ends = np.cumsum([len(c.token_ids) for c in ordered]) - 1
        last_index = {c.seq_id: int(end) for c, end in zip(ordered, ends) if c.needs_sample}
        sample_index = mx.array([last_index[c.seq_id] for c in batch.chunks if c.needs_sample], dtype=mx.int32)

        attention = PagedAttention(self.kv_cache, metadata, self.scale)
        hidden = self.model(mx.array(tokens), mx.array(positions.astype(np.int32)), attention)
        logits = self.model.logits(hidden[sample_index])
        mx.eval(logits, self.kv_cache.keys, self.kv_cache.values)
        return logits

    def _attention_groups(self, chunks: list[ScheduledChunk]) -> list[list[ScheduledChunk]]:
        """Split prefill chunks into query tiles and group the pieces by how far back they read.

        Attention pads each group to [pieces, longest piece, longest context]. A whole prompt
        padded that way computes every query against every key, masked half included; as tiles
        of `query_tile` tokens, each reads only the blocks up to its own last token. Grouping by
        reach (contexts within a power of two) keeps the context padding small, and single-token
        pieces (decodes) never share a group with tiles, whose length they would be padded to.
        All K/V of the step are written before any attention, so tiles of one chunk see each other.
        """
        groups: dict[tuple[bool, int], list[ScheduledChunk]] = {}
        for chunk in chunks:
            for start in range(0, len(chunk.token_ids), self.query_tile):
                token_ids = chunk.token_ids[start:start + self.query_tile]
                is_last = start + len(token_ids) == len(chunk.token_ids)
                piece = chunk._replace(token_ids=token_ids, start_position=chunk.start_position + start,
                                       needs_sample=chunk.needs_sample and is_last)
                reach = (self._blocks_read(piece) - 1).bit_length()
                groups.setdefault((len(token_ids) > 1, reach), []).append(piece)
        return [groups[key] for key in sorted(groups)]

    def _blocks_read(self, chunk: ScheduledChunk) -> int:
        """Blocks up to the chunk's last token: all its queries may see."""
        return (chunk.start_position + len(chunk.token_ids) - 1) // self.block_size + 1

    def _slots(self, chunk: ScheduledChunk, positions: np.ndarray) -> np.ndarray:
        table = np.asarray(chunk.block_table, dtype=np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _group(self, chunks: list[ScheduledChunk], offset: int) -> AttentionGroup:
        lengths = np.array([len(c.token_ids) for c in chunks])
        L = int(lengths.max())
        # Padding queries repeat the chunk's last token: valid to compute, dropped by unpad_index.
        steps = np.minimum(np.arange(L)[None, :], lengths[:, None] - 1)
        starts = offset + np.concatenate([[0], np.cumsum(lengths)[:-1]])
        token_index = starts[:, None] + steps
        positions = np.array([c.start_position for c in chunks])[:, None] + steps
        # Read only the blocks up to each chunk's last token: a long prompt's first chunk
        # must not pay for attending over the blocks reserved for its later chunks.
        num_blocks = [self._blocks_read(c) for c in chunks]
        tables = np.zeros((len(chunks), max(num_blocks)), dtype=np.int32)
        for row, (chunk, n) in enumerate(zip(chunks, num_blocks)):
            tables[row, :n] = chunk.block_table[:n]
        unpad = None
        if L > 1:
            unpad = mx.array(np.flatnonzero(np.arange(L)[None, :] < lengths[:, None]).astype(np.int32))
        # One mask per step, shared by every layer: a query sees the slots up to its own position.
        context = mx.arange(tables.shape[1] * self.block_size)
        visible = context[None, None, :] <= mx.array(positions.astype(np.int32))[:, :, None]
        return AttentionGroup(mx.array(token_index.astype(np.int32)), visible, mx.array(tables), unpad)
