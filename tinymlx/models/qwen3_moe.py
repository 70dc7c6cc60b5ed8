"""Qwen3-MoE: Qwen3's attention; the MLP of every `decoder_sparse_step`-th layer (except `mlp_only_layers`)
is a softmax-routed mixture of experts (moe.py), the others a dense SwiGLU.

Every checkpoint layout of the experts is stacked into `mlp.switch_mlp.*` [E, out, in] (moe.stack_experts),
mlx-lm's names, so its MoE checkpoints load as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from tinymlx.models import hf_config, qwen2, qwen3
from tinymlx.models.base import CausalLM
from tinymlx.models.gguf_arch import GGUFArch, Metadata, dense_config
from tinymlx.models.layers import MLP, activation
from tinymlx.models.moe import SparseMoE, stack_experts


def _gguf_config(meta: Metadata) -> dict[str, Any]:
    """llama.cpp's qwen3moe: every layer sparse, and the top-k weights always renormalized."""
    experts_ffn = meta.need("expert_feed_forward_length")
    return {**dense_config(meta, intermediate_size=meta.get("feed_forward_length", experts_ffn)),
            "num_experts": meta.need("expert_count"), "num_experts_per_tok": meta.need("expert_used_count"),
            "moe_intermediate_size": experts_ffn, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": []}


# The experts come stacked, [E, out, in] as PyTorch orders them: mlx-lm's switch_mlp layout as it is.
GGUF_LAYER_TENSORS = {**qwen3.GGUF_LAYER_TENSORS, "ffn_gate_inp": "mlp.gate",
                      "ffn_gate_exps": "mlp.switch_mlp.gate_proj", "ffn_up_exps": "mlp.switch_mlp.up_proj",
                      "ffn_down_exps": "mlp.switch_mlp.down_proj"}
GGUF_ARCHS = (GGUFArch("qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe", GGUF_LAYER_TENSORS, _gguf_config),)


@dataclass(frozen=True, kw_only=True)
class ModelArgs(qwen3.ModelArgs):
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        dense = qwen3.ModelArgs.from_config(config)
        # transformers' Qwen3-MoE has no layer_types: use_sliding_window puts every layer behind the window.
        windowed = config.get("use_sliding_window") and config.get("sliding_window") is not None
        types = hf_config.layer_types(config, lambda _: hf_config.SLIDING if windowed else hf_config.FULL)
        return cls(**{**vars(dense), "layer_types": types, "sliding_window": hf_config.sliding_window(config, types)},
                   num_experts=hf_config.first_of(config, "num_experts", "num_local_experts"), num_experts_per_tok=config["num_experts_per_tok"],
                   moe_intermediate_size=config["moe_intermediate_size"],
                   norm_topk_prob=config.get("norm_topk_prob", False),
                   decoder_sparse_step=config.get("decoder_sparse_step", 1),
                   mlp_only_layers=tuple(config.get("mlp_only_layers") or ()))

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and self.num_experts > 0 and (layer + 1) % self.decoder_sparse_step == 0

    def ffn_widths(self) -> dict[str, int]:
        widths = {"experts' down_proj": self.moe_intermediate_size}
        if not all(self.is_sparse(i) for i in range(self.num_hidden_layers)):
            widths["down_proj"] = self.intermediate_size
        return widths


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        act = activation(args.hidden_act)

        def mlp(layer: int) -> nn.Module:
            if args.is_sparse(layer):
                return SparseMoE(args.hidden_size, args.moe_intermediate_size, args.num_experts,
                                 args.num_experts_per_tok, args.norm_topk_prob, act)
            return MLP(args.hidden_size, args.intermediate_size, act)

        layers = [qwen2.DecoderLayer(args, i, mlp(i), qk_norm=True) for i in range(args.num_hidden_layers)]
        self.model = qwen2.Qwen2Model(args, layers)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return stack_experts(super().sanitize(weights), self.args.num_experts)
