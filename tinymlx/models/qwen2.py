"""Qwen2 in MLX: RMSNorm, grouped-query attention with RoPE and q/k/v bias, SwiGLU.

Llama-family checkpoints run through the same modules with the bias off. The model works on a
flat list of tokens from many sequences at once; *how* attention reaches each sequence's K/V
(paged pool or dense reference) is the `AttentionBackend` passed in, so this file knows no cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from tinymlx import fast_math


@dataclass(frozen=True)
class ModelArgs:
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = True

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        model_type = config.get("model_type", "qwen2")
        heads = config["num_attention_heads"]
        return cls(
            model_type=model_type,
            hidden_size=config["hidden_size"],
            num_hidden_layers=config["num_hidden_layers"],
            intermediate_size=config["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            vocab_size=config["vocab_size"],
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=config.get("rope_theta", 10000.0),
            rope_scaling=config.get("rope_scaling"),
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v bias; Llama only when the config says so.
            attention_bias=config.get("attention_bias", model_type == "qwen2"),
        )


class AttentionBackend(Protocol):
    """Stores this step's K/V for `layer` and returns attention output [N, num_heads, head_dim]."""

    def __call__(self, layer: int, q: mx.array, k: mx.array, v: mx.array) -> mx.array: ...


def _rope_frequencies(args: ModelArgs) -> tuple[float | None, float, mx.array | None]:
    """(base, scale, freqs) for mx.fast.rope: plain, linear-scaled or Llama-3-scaled RoPE."""
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in ("default", None):
        return args.rope_theta, 1.0, None
    if kind == "linear":
        return args.rope_theta, 1.0 / scaling["factor"], None
    if kind == "llama3":
        dims = args.head_dim
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_context = scaling.get("original_max_position_embeddings", 8192)
        freqs = args.rope_theta ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        wavelens = 2 * math.pi * freqs
        freqs = mx.where(wavelens > old_context / low, freqs * factor, freqs)
        smooth = (old_context / wavelens - low) / (high - low)
        smoothed = freqs / ((1 - smooth) / factor + smooth)
        is_medium = (wavelens > old_context / high) & (wavelens < old_context / low)
        return None, 1.0, mx.where(is_medium, smoothed, freqs)
    raise ValueError(f"unsupported rope_scaling type {kind!r} (supported: linear, llama3)")


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = args.num_attention_heads
        self.num_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        dim, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(dim, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, dim, bias=False)
        self._rope_base, self._rope_scale, self._rope_freqs = _rope_frequencies(args)

    def _rope(self, x: mx.array, positions: mx.array) -> mx.array:
        # mx.fast.rope rotates along axis -2 from `offset`; a length-1 axis there with one
        # offset per token gives every token of every sequence its own position.
        rotated = mx.fast.rope(
            x[:, :, None, :], self.head_dim, traditional=False, base=self._rope_base,
            scale=self._rope_scale, offset=positions, freqs=self._rope_freqs,
        )
        return rotated[:, :, 0, :]

    def __call__(self, x: mx.array, positions: mx.array, attention: AttentionBackend) -> mx.array:
        N, _ = x.shape
        q = self.q_proj(x).reshape(N, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(N, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(N, self.num_kv_heads, self.head_dim)
        q, k = self._rope(q, positions), self._rope(k, positions)
        out = attention(self.layer, q, k, v)
        return self.o_proj(out.reshape(N, -1))


class InputMajorLinear(nn.Module):
    """nn.Linear with its float weight stored transposed, [in, out], for BLAS.

    OpenBLAS runs x @ W faster than x @ W.T when W is wide: measured at M = 1 and 32, the
    151,936-wide lm_head 1.3-1.8x, gate/up 1.15-1.25x, q/o level. down_proj (narrow) is 10-15%
    slower alone, yet the whole decode step measured level with it in either layout, so one rule
    converts every float linear. Checkpoints keep HF's [out, in]; `use_input_major_linears`
    converts a loaded model.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight_t = mx.contiguous(linear.weight.T)
        if "bias" in linear:
            self.bias = linear.bias

    def __call__(self, x: mx.array) -> mx.array:
        y = x @ self.weight_t
        return y + self.bias if "bias" in self else y


def use_input_major_linears(model: nn.Module) -> None:
    """Swap every float nn.Linear for an InputMajorLinear (for float32 on the CPU, where matmuls run in BLAS)."""
    def convert(_path: str, module: nn.Module) -> nn.Module:
        if type(module) is not nn.Linear:
            return module
        converted = InputMajorLinear(module)
        mx.eval(converted.parameters())
        module.pop("weight")  # free the [out, in] copy now: memory grows by one layer, not by the model
        return converted

    model.update_modules(tree_map_with_path(convert, model.leaf_modules(), is_leaf=nn.Module.is_module))


def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up without mx.sigmoid, whose exp is the slow one (see fast_math): this is the
    largest elementwise op of a step."""
    return gate / (1.0 + fast_math.exp(gate, scale=-1.0)) * up


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, positions: mx.array, attention: AttentionBackend) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), positions, attention)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen2Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, tokens: mx.array, positions: mx.array, attention: AttentionBackend) -> mx.array:
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h, positions, attention)
        return self.norm(h)


class Model(nn.Module):
    """Module names follow Hugging Face, so checkpoints load without renaming."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tensor_parallel_size = 1
        self._vocab_rows: slice | None = None  # under tensor parallelism: this rank's slice of the vocabulary
        self._gather_vocab: Callable[[mx.array], mx.array] | None = None
        self.model = Qwen2Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank computes and caches (all of them without tensor parallelism)."""
        return self.args.num_key_value_heads // self.tensor_parallel_size

    def __call__(self, tokens: mx.array, positions: mx.array, attention: AttentionBackend) -> mx.array:
        """Hidden states [N, hidden] for flat `tokens` [N] at `positions` [N]."""
        return self.model(tokens, positions, attention)

    def logits(self, hidden: mx.array) -> mx.array:
        """Logits [rows, vocab]. Sharded, each rank computes its slice of the vocabulary and the
        slices are gathered: every rank must call this with the same rows."""
        if self._vocab_rows is None:
            head = self.model.embed_tokens.as_linear if self.args.tie_word_embeddings else self.lm_head
            return head(hidden)
        # Imported here, as in shard(): tinymlx.parallel imports this module.
        from tinymlx.parallel.sharded_linear import embedding_rows_as_linear

        if self.args.tie_word_embeddings:
            logits = embedding_rows_as_linear(self.model.embed_tokens, hidden, self._vocab_rows)
        else:
            logits = self.lm_head(hidden)
        return self._gather_vocab(logits)

    def shard(self, group: mx.distributed.Group, all_reduce: Callable[[mx.array], mx.array],
              gather_vocab: Callable[[mx.array], mx.array]) -> None:
        """Keep this rank's slice of every layer, Megatron style (call before any dtype conversion).

        q/k/v and gate/up keep whole heads / FFN columns (output features); o_proj and down_proj keep
        the matching input features and sum their partial outputs over the ranks: two all-reduces
        per layer. The lm_head keeps a slice of the vocabulary, whose logits are gathered (one
        all-gather per step); the embedding stays whole, since every rank looks up every token.
        """
        from tinymlx.parallel.sharded_linear import shard_input_features, shard_output_features

        size, rank = group.size(), group.rank()
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for name in ("q_proj", "k_proj", "v_proj"):
                shard_output_features(attn, name, group)
            attn.num_heads //= size
            attn.num_kv_heads //= size
            shard_input_features(attn, "o_proj", group, all_reduce)
            for name in ("gate_proj", "up_proj"):
                shard_output_features(mlp, name, group)
            shard_input_features(mlp, "down_proj", group, all_reduce)
        if not self.args.tie_word_embeddings:
            shard_output_features(self, "lm_head", group)
        per_rank = self.args.vocab_size // size
        self._vocab_rows, self._gather_vocab = slice(rank * per_rank, (rank + 1) * per_rank), gather_vocab
        self.tensor_parallel_size = size

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # Rotary tables are recomputed, never loaded; tied checkpoints may still ship lm_head.
        return {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
