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
    def __init__(self, model: Model, config: EngineConfig):
        assert config.is_resolved, "resolve the config against the model first"
        self.model, self.block_size = model, config.block_size
        args = model.args
        self.kv_cache = PagedKVCache(
            args.num_hidden_layers, config.num_blocks, config.block_size,
            args.num_key_value_heads, args.head_dim, activation_dtype(model),
        )
        self.scale = args.head_dim**-0.5

    def run(self, batch: ScheduledBatch) -> mx.array:
        """Logits [num_sampled_chunks, vocab] for the last token of each chunk that samples.

        Every chunk of the batch goes through one forward; tokens are laid out flat
        (single-token chunks first) so the linear layers never see padding.
        """
        singles = [c for c in batch.chunks if len(c.token_ids) == 1]
        multis = [c for c in batch.chunks if len(c.token_ids) > 1]
        ordered = singles + multis
        tokens = np.fromiter((t for c in ordered for t in c.token_ids), dtype=np.int32)
        chunk_positions = [np.arange(c.start_position, c.start_position + len(c.token_ids)) for c in ordered]
        positions = np.concatenate(chunk_positions)
        slots = np.concatenate([self._slots(c, p) for c, p in zip(ordered, chunk_positions)])

        groups, offset = [], 0
        for chunks in (singles, multis):
            if chunks:
                groups.append(self._group(chunks, offset))
                offset += sum(len(c.token_ids) for c in chunks)
        metadata = PagedAttentionMetadata(mx.array(slots, dtype=mx.int32), tuple(groups))

        last_index, offset = {}, 0
        for chunk in ordered:
            offset += len(chunk.token_ids)
            last_index[chunk.seq_id] = offset - 1
        sample_index = mx.array([last_index[c.seq_id] for c in batch.chunks if c.needs_sample], dtype=mx.int32)

        attention = PagedAttention(self.kv_cache, metadata, self.scale)
        hidden = self.model(mx.array(tokens), mx.array(positions.astype(np.int32)), attention)
        logits = self.model.logits(hidden[sample_index])
        mx.eval(logits, self.kv_cache.keys, self.kv_cache.values)
        return logits

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
        num_blocks = [(c.start_position + len(c.token_ids) - 1) // self.block_size + 1 for c in chunks]
        tables = np.zeros((len(chunks), max(num_blocks)), dtype=np.int32)
        for row, (chunk, n) in enumerate(zip(chunks, num_blocks)):
            tables[row, :n] = chunk.block_table[:n]
        unpad = None
        if L > 1:
            unpad = mx.array(np.flatnonzero(np.arange(L)[None, :] < lengths[:, None]).astype(np.int32))
        return AttentionGroup(
            mx.array(token_index.astype(np.int32)), mx.array(positions.astype(np.int32)), mx.array(tables), unpad
        )
