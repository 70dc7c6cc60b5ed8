"""Qwen3: Qwen2's layers with an RMSNorm over each query and key head before RoPE, and no q/k/v bias.

The small sizes (0.6B-4B) tie the lm_head to the embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

from tinymlx.models import qwen2
from tinymlx.models.base import CausalLM
from tinymlx.models.gguf_arch import QK_NORM_TENSORS, GGUFArch
from tinymlx.models.layers import MLP, activation

GGUF_LAYER_TENSORS = {**qwen2.GGUF_LAYER_TENSORS, **QK_NORM_TENSORS}
GGUF_ARCHS = (GGUFArch("qwen3", "Qwen3ForCausalLM", "qwen3", GGUF_LAYER_TENSORS),)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(qwen2.ModelArgs):
    """Qwen2's arguments (from_config reads both); only the bias default differs."""

    attention_bias: bool = False


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        act = activation(args.hidden_act)
        layers = [qwen2.DecoderLayer(args, i, MLP(args.hidden_size, args.intermediate_size, act), qk_norm=True)
                  for i in range(args.num_hidden_layers)]
        self.model = qwen2.Qwen2Model(args, layers)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
