"""gpt-oss (20b, 120b): sliding-window (128) and full-attention layers in turn, with attention sinks, and a
mixture of experts in every layer.

    attention: q/k/v/o with biases; YaRN RoPE; per head a learned sink logit that joins every softmax
               and takes its share of the mass without a value (models pass it to the backend:
               ops/attention.py applies it in every path)
    MoE:       a router with a bias picks the top k of 32-128 experts and softmaxes their logits; each
               expert is a clamped SwiGLU with biases: g = min(gate, 7), u = clip(up, -7, 7),
               (u + 1) * g * sigmoid(1.702 g), batched through gather_mm like Qwen3-MoE's (moe.py)

Hugging Face's checkpoints store the experts fused and input-major: gate_up_proj [E, hidden, 2I] with
gate and up interleaved column by column, down_proj [E, I, hidden], each with a bias; `sanitize` turns
them into the stacked [E, out, in] SwitchLinears (mlx-lm's names), and the router into `mlp.gate`.

As published, the experts are MXFP4 (`*_blocks` [E, out, in/32, 16] bytes of two 4-bit values, low nibble
first, `*_scales` [E, out, in/32] e8m0): exactly MLX's own mxfp4 layout once the bytes are read as uint32,
so they load as MLX's quantized experts (gather_qmm, mode "mxfp4"), never dequantized; gate and up are
every other row of the fused weight. mlx-lm's converted checkpoints (`mlp.experts.gate_proj.*`, split
already; `mlp.router`) load by their names, and so do llama.cpp's GGUF files (`gpt-oss`: experts split
and out-major too; MXFP4 experts dequantized by gguf-py, or requantized under dtype "native").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from tinymlx.models import hf_config, qwen2
from tinymlx.models.base import BaseModelArgs, CausalLM
from tinymlx.models.gguf_arch import ATTENTION_TENSORS, GGUFArch, Metadata, dense_config, f32
from tinymlx.models.moe import SparseMoE
from tinymlx.ops import kernels


@dataclass(frozen=True, kw_only=True)
class ModelArgs(BaseModelArgs):
    intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 150_000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = True
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        types = hf_config.layer_types(config, lambda i: hf_config.SLIDING if i % 2 == 0 else hf_config.FULL)
        theta, scaling = hf_config.rope_for(config, hf_config.FULL, 150_000.0)
        return cls(
            model_type="gpt_oss", **hf_config.dense_shape(config),
            num_local_experts=config["num_local_experts"], num_experts_per_tok=config["num_experts_per_tok"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-5), rope_theta=theta, rope_scaling=scaling,
            attention_bias=config.get("attention_bias", True), swiglu_limit=config.get("swiglu_limit", 7.0),
            swiglu_alpha=config.get("swiglu_alpha", 1.702),
            max_position_embeddings=config.get("max_position_embeddings", 131_072),
            tie_word_embeddings=config.get("tie_word_embeddings", False), layer_types=types,
            sliding_window=hf_config.sliding_window(config, types),
        )

    def ffn_widths(self) -> dict[str, int]:
        return {"experts' down_proj": self.intermediate_size}


def clamped_swiglu(limit: float, alpha: float) -> Callable[[mx.array, mx.array], mx.array]:
    def act(gate: mx.array, up: mx.array) -> mx.array:
        gate = mx.minimum(gate, limit)
        return (mx.clip(up, -limit, limit) + 1) * gate * kernels.sigmoid(alpha * gate)
    return act


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        act = clamped_swiglu(args.swiglu_limit, args.swiglu_alpha)
        layers = [qwen2.DecoderLayer(args, i, SparseMoE(args.hidden_size, args.intermediate_size,
                                                         args.num_local_experts, args.num_experts_per_tok,
                                                         norm_topk_prob=True, act=act, bias=True),
                                     out_bias=args.attention_bias, sinks=True)
                  for i in range(args.num_hidden_layers)]
        self.model = qwen2.Qwen2Model(args, layers)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Hugging Face's fused, input-major experts (see the module's docstring) as SwitchLinears."""
        out = {}
        for name, value in weights.items():
            mlp, _, part = name.partition(".mlp.")
            if name.endswith(".self_attn.sinks.weight"):  # llama.cpp names the sinks a weight
                out[name.removesuffix(".weight")] = value
            elif not part:
                out[name] = value
            elif part.startswith("router."):  # (GGUF's ffn_gate_inp converts to this name)
                out[f"{mlp}.mlp.gate.{part.removeprefix('router.')}"] = value
            elif part.count(".") == 2 and part.rpartition(".")[0] in ("experts.gate_proj", "experts.up_proj",
                                                                         "experts.down_proj"):
                out[f"{mlp}.mlp.switch_mlp.{part.removeprefix('experts.')}"] = value  # mlx-lm's, split already
            elif part in ("experts.gate_up_proj", "experts.gate_up_proj_bias"):
                suffix = "weight" if part.endswith("proj") else "bias"
                gate, up = value[..., ::2], value[..., 1::2]
                if suffix == "weight":  # [E, hidden, I] -> [E, I, hidden]
                    gate, up = gate.swapaxes(-1, -2), up.swapaxes(-1, -2)
                out[f"{mlp}.mlp.switch_mlp.gate_proj.{suffix}"] = gate
                out[f"{mlp}.mlp.switch_mlp.up_proj.{suffix}"] = up
            elif part in ("experts.gate_up_proj_blocks", "experts.gate_up_proj_scales"):
                value = _mxfp4_weight(value) if part.endswith("blocks") else value
                suffix = "weight" if part.endswith("blocks") else "scales"
                out[f"{mlp}.mlp.switch_mlp.gate_proj.{suffix}"] = value[:, ::2]
                out[f"{mlp}.mlp.switch_mlp.up_proj.{suffix}"] = value[:, 1::2]
            elif part == "experts.down_proj_blocks":
                out[f"{mlp}.mlp.switch_mlp.down_proj.weight"] = _mxfp4_weight(value)
            elif part == "experts.down_proj_scales":
                out[f"{mlp}.mlp.switch_mlp.down_proj.scales"] = value
            elif part == "experts.down_proj":
                out[f"{mlp}.mlp.switch_mlp.down_proj.weight"] = value.swapaxes(-1, -2)
            elif part == "experts.down_proj_bias":
                out[f"{mlp}.mlp.switch_mlp.down_proj.bias"] = value
            else:
                out[name] = value
        # Contiguous: a strided view of every other row made each gather_qmm copy all the experts' weights
        # (a gpt-oss-shaped layer's decode MoE: 15.8 ms, against 5 with them contiguous).
        return super().sanitize({name: mx.contiguous(value) if ".switch_mlp." in name else value
                                 for name, value in out.items()})


def _mxfp4_weight(blocks: mx.array) -> mx.array:
    """[E, out, in/32, 16] bytes -> MLX's packed [E, out, in/8] uint32 (the same nibbles, little-endian)."""
    return blocks.reshape(*blocks.shape[:-2], -1).view(mx.uint32)


def _gguf_config(meta: Metadata) -> dict[str, Any]:
    """llama.cpp's gpt-oss keys. What it hard-codes for the family (src/llama-model.cpp), so do we: sliding
    layers first, then in turn; YaRN's betas 32 and 1, untruncated; the SwiGLU clamp."""
    config = dense_config(meta, intermediate_size=meta.need("expert_feed_forward_length"))
    layers = config["num_hidden_layers"]
    config.update(
        num_local_experts=meta.need("expert_count"), num_experts_per_tok=meta.need("expert_used_count"),
        sliding_window=meta.need("attention.sliding_window"), attention_bias=True,
        layer_types=[hf_config.SLIDING if i % 2 == 0 else hf_config.FULL for i in range(layers)],
    )
    if config.get("rope_scaling") is not None:
        config["rope_scaling"].update(beta_fast=32.0, beta_slow=1.0, truncate=False)
        config["rope_scaling"]["factor"] = f32(config["rope_scaling"]["factor"])
    return config


GGUF_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    **ATTENTION_TENSORS,
    "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
GGUF_ARCHS = (GGUFArch("gpt-oss", "GptOssForCausalLM", "gpt_oss", GGUF_LAYER_TENSORS, _gguf_config),)
