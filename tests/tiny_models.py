"""Tiny random models and a byte tokenizer: fast stand-ins for engine and scheduler tests."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from tinymlx.attention import DenseAttention
from tinymlx.batch import ScheduledBatch, ScheduledChunk
from tinymlx.config import EngineConfig
from tinymlx.engine import Engine
from tinymlx.model_runner import ModelRunner
from tinymlx.models.qwen2 import Model, ModelArgs


def tiny_args(model_type: str = "qwen2", vocab_size: int = 300, **overrides) -> ModelArgs:
    values = dict(
        model_type=model_type, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size, head_dim=16,
        rope_theta=10000.0, max_position_embeddings=1024, attention_bias=model_type == "qwen2",
    )
    values.update(overrides)
    return ModelArgs(**values)


def tiny_model(seed: int = 0, **overrides) -> Model:
    """A random model whose weights are large enough that attention patterns actually matter."""
    model = Model(tiny_args(**overrides))
    rng = np.random.default_rng(seed)
    params = [(name, mx.array(rng.normal(0, 0.3, p.shape).astype(np.float32)))
              for name, p in _flatten(model.parameters())]
    model.load_weights(params)
    mx.eval(model.parameters())
    return model


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}{key}.")
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _flatten(value, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def dense_logits(model: Model, token_ids: list[int]) -> mx.array:
    """Reference: logits at every position of one sequence, plain causal attention, no cache."""
    n = len(token_ids)
    hidden = model(mx.array(token_ids), mx.arange(n), DenseAttention(1, n, model.args.head_dim**-0.5))
    return model.logits(hidden)


def paged_logits(model: Model, token_ids: list[int], prompt_len: int, block_size: int,
                 chunk_size: int | None = None, seed: int = 0, query_tile: int = 64) -> list[mx.array]:
    """Logits for positions prompt_len-1 .. n-1: chunked prefill, then teacher-forced decode steps.

    The block table is a random permutation, so contiguity can't hide an addressing bug.
    """
    n = len(token_ids)
    num_blocks = -(-n // block_size) + 3
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks).resolve(model.args, mx.float32)
    runner = ModelRunner(model, config, query_tile=query_tile)
    table = np.random.default_rng(seed).permutation(num_blocks)[: -(-n // block_size)].tolist()
    chunk_size = chunk_size or prompt_len
    results, start = [], 0
    while start < n:
        end = min(start + chunk_size, prompt_len) if start < prompt_len else start + 1
        chunk = ScheduledChunk(0, token_ids[start:end], start, table, end >= prompt_len)
        logits = runner.run(ScheduledBatch([chunk], end - start, []))
        if chunk.needs_sample:
            results.append(logits[0])
        start = end
    return results


class ByteTokenizer:
    """Bytes are tokens 0-255; 256 is EOS. Enough for engine tests on tiny models."""

    eos_token_ids = frozenset({256})
    bos_token_id = None
    vocab_size = 300

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))


def tiny_engine(seed: int = 0, **config) -> Engine:
    config.setdefault("block_size", 4)
    config.setdefault("num_blocks", 256)
    return Engine(tiny_model(seed), ByteTokenizer(), EngineConfig(**config), model_name="tiny-qwen2")
