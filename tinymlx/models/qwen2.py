"""Qwen2 and Llama: RMSNorm, grouped-query attention with RoPE (q/k/v bias for Qwen2), SwiGLU.

Llama-family checkpoints run through the same modules with the bias off. Qwen3 (qwen3.py) adds
q/k RMSNorm to these same modules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from tinymlx.core.pipeline_stage import whole_model
from tinymlx.models import hf_config
from tinymlx.models.base import AttentionBackend, BaseModelArgs, CausalLM
from tinymlx.models.gguf_arch import ATTENTION_TENSORS, MLP_TENSORS, PRE_NORM_TENSORS, GGUFArch
from tinymlx.models.layers import MLP, Attention, RMSNorm, activation, finish_stage, only_rows
from tinymlx.models.rope import MRoPE, RoPE

GGUF_LAYER_TENSORS = {**PRE_NORM_TENSORS, **ATTENTION_TENSORS, **MLP_TENSORS}
GGUF_ARCHS = (
    GGUFArch("qwen2", "Qwen2ForCausalLM", "qwen2", GGUF_LAYER_TENSORS),
    # llama.cpp's convert script permutes Q/K rows for its pairwise RoPE only in llama-style archs.
    GGUFArch("llama", "LlamaForCausalLM", "llama", GGUF_LAYER_TENSORS, permute_qk=True),
)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(BaseModelArgs):
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = True
    hidden_act: str = "silu"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        model_type = config.get("model_type", "qwen2")
        types = hf_config.qwen_layer_types(config)  # Llama has no sliding layers: all full
        theta, scaling = hf_config.rope_for(config, hf_config.FULL, 10000.0)
        return cls(
            model_type=model_type,
            **hf_config.dense_shape(config),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v bias; Llama and Qwen3 only when the config says so.
            attention_bias=config.get("attention_bias", model_type == "qwen2"),
            hidden_act=config.get("hidden_act", "silu"),
            layer_types=types,
            sliding_window=hf_config.sliding_window(config, types),
        )


class DecoderLayer(nn.Module):
    """Pre-norm: h = x + attn(norm(x)); out = h + mlp(norm(h)). `mlp` is any block with a `shard`; the
    attention's options are the families' (Qwen3's q/k norms; gpt-oss's o_proj bias and sinks)."""

    def __init__(self, args: ModelArgs, layer: int, mlp: nn.Module, qk_norm: bool = False,
                 out_bias: bool = False, sinks: bool = False, rope: RoPE | MRoPE | None = None):
        super().__init__()
        norm = (lambda dims: RMSNorm(dims, args.rms_norm_eps)) if qk_norm else None
        rope = rope or RoPE(args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings)
        self.self_attn = Attention(layer, args.hidden_size, args.num_attention_heads, args.num_key_value_heads,
                                   args.head_dim, rope, bias=args.attention_bias, out_bias=out_bias,
                                   qk_norm=norm, sinks=sinks)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x: mx.array, positions: mx.array, attention: AttentionBackend,
                 rows: mx.array | None = None) -> mx.array:
        h = only_rows(x + self.self_attn(self.input_layernorm(x), positions, attention), rows)
        return h + self.mlp(self.post_attention_layernorm(h))

    def shard(self, group: mx.distributed.Group, all_reduce: Callable[[mx.array], mx.array]) -> None:
        self.self_attn.shard(group, all_reduce)
        self.mlp.shard(group, all_reduce)


class Qwen2Model(nn.Module):
    def __init__(self, args: BaseModelArgs, layers: list[nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = layers
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.stage = whole_model(args.num_hidden_layers)

    def __call__(self, tokens: mx.array, positions: mx.array, attention: AttentionBackend,
                 rows: mx.array | None = None, embeds: mx.array | None = None) -> mx.array:
        """`embeds`: the tokens' input embeddings where the caller made them (a vision model's image rows, or a
        pipeline stage's input)."""
        h = self.embed_tokens(tokens) if embeds is None else embeds
        return finish_stage(self, h, positions, attention, rows)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        act = activation(args.hidden_act)
        layers = [DecoderLayer(args, i, MLP(args.hidden_size, args.intermediate_size, act))
                  for i in range(args.num_hidden_layers)]
        self.model = Qwen2Model(args, layers)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
