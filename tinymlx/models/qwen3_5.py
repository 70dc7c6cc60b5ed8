"""Qwen3.5 (and Qwen3.5-MoE): three of every four layers are Gated DeltaNet linear attention, every fourth
gated full attention. Qwen3-Next (qwen3_next.py) is the same model with fused input projections.

    linear_attention layers (Recurrent: a conv state and a delta-rule state per sequence, no K/V):
        x -> in_proj_qkv -> causal depthwise conv1d + SiLU -> q, k (L2-normalised), v
          -> in_proj_a, in_proj_b -> decay g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)
          -> gated delta rule (gated_delta.py) -> RMSNorm gated by silu(in_proj_z(x)) -> out_proj
    full_attention layers: q_proj gives the query and a gate; q/k RMSNorm; RoPE on the first quarter
        of each head (partial_rotary_factor; with text positions only, multimodal RoPE reduces to it);
        the output is multiplied by sigmoid(gate) before o_proj.

RMSNorms (not the gated one) scale by 1 + w in Hugging Face's checkpoints; mlx-lm's converted
checkpoints store 1 + w and their conv1d weight as [C, K, 1]. The module tree here is mlx-lm's, so
its checkpoints load as they are, and `sanitize` converts Hugging Face's (told apart by the conv1d layout).
The released checkpoints (`qwen3_5` with a `text_config`) nest the text model under
model.language_model beside a vision tower (read by qwen3_5_vl.py, with multimodal RoPE; never here) and a
multi-token-prediction head (`mtp.*`), which the target never reads: `mtp_head` builds it apart, for
speculative decoding (models/mtp.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace

from tinymlx.core.layer_specs import FullAttention, LayerSpec, Recurrent
from tinymlx.models import hf_config, qwen2
from tinymlx.models.base import AttentionBackend, BaseModelArgs, CausalLM
from tinymlx.models.checkpoint import text_model_weights
from tinymlx.models.layers import MLP, Attention, RMSNorm, activation, only_rows
from tinymlx.models.moe import SharedExpertMoE, stack_experts
from tinymlx.models.mtp import MTPBody
from tinymlx.models.rope import MRoPE, RoPE
from tinymlx.models.sharding import shard_input_features, shard_output_features
from tinymlx.ops import kernels

LINEAR = "linear_attention"
_NOT_TEXT = ("model.visual.", "visual.", "mtp.", "model.mtp.")
# Zero-centred in Hugging Face's checkpoints: mlx-lm's (and this module tree) hold 1 + w.
_OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                 ".q_norm.weight", ".k_norm.weight")
_MTP_OFFSET_NORMS = (*_OFFSET_NORMS, "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")


@dataclass(frozen=True, kw_only=True)
class ModelArgs(BaseModelArgs):
    intermediate_size: int
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    rope_scaling: dict[str, Any] | None = None
    partial_rotary_factor: float = 0.25
    attention_bias: bool = False
    hidden_act: str = "silu"
    # The MoE variants (Qwen3.5-MoE, Qwen3-Next): 0 experts is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        model_type = config.get("model_type")
        if "text_config" in config:  # qwen3_5 with a vision tower: the text model's part only
            config = {"tie_word_embeddings": config.get("tie_word_embeddings", False), **config["text_config"]}
        every = config.get("full_attention_interval", 4)
        types = hf_config.layer_types(config, lambda i: hf_config.FULL if (i + 1) % every == 0 else LINEAR)
        theta, scaling = hf_config.rope_for(config, hf_config.FULL, 10_000_000.0)
        rope = config.get("rope_parameters") or {}
        return cls(
            model_type=model_type, hidden_size=config["hidden_size"], num_hidden_layers=config["num_hidden_layers"],
            vocab_size=config["vocab_size"], **hf_config.heads(config),
            intermediate_size=config.get("intermediate_size", 0),  # Qwen3.5-MoE: every layer's MLP is sparse
            max_position_embeddings=config.get("max_position_embeddings", 32768),
            tie_word_embeddings=config.get("tie_word_embeddings", False), layer_types=types,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=theta,
            rope_scaling=_without_rope_layout(scaling),
            partial_rotary_factor=rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25)),
            attention_bias=config.get("attention_bias", False), hidden_act=config.get("hidden_act", "silu"),
            linear_conv_kernel_dim=config["linear_conv_kernel_dim"],
            linear_key_head_dim=config["linear_key_head_dim"], linear_value_head_dim=config["linear_value_head_dim"],
            linear_num_key_heads=config["linear_num_key_heads"],
            linear_num_value_heads=config["linear_num_value_heads"],
            num_experts=config.get("num_experts", 0), num_experts_per_tok=config.get("num_experts_per_tok", 0),
            moe_intermediate_size=config.get("moe_intermediate_size", 0),
            shared_expert_intermediate_size=config.get("shared_expert_intermediate_size", 0),
            norm_topk_prob=config.get("norm_topk_prob", True),
            decoder_sparse_step=config.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(config.get("mlp_only_layers") or ()),
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        unknown = sorted(set(self.layer_types) - {hf_config.FULL, LINEAR})
        if unknown:
            raise ValueError(f"layer types {unknown} are not supported by {self.model_type}")

    def is_sparse(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def recurrent_spec(self, ranks: int = 1) -> Recurrent:
        """One Gated DeltaNet layer's state on each of `ranks` tensor-parallel ranks (its share of the heads)."""
        key_dim = self.linear_num_key_heads * self.linear_key_head_dim
        return Recurrent(kernel=self.linear_conv_kernel_dim,
                         conv_dim=(2 * key_dim + self.linear_num_value_heads * self.linear_value_head_dim) // ranks,
                         heads=self.linear_num_value_heads // ranks, key_dim=self.linear_key_head_dim,
                         value_dim=self.linear_value_head_dim)

    def whole_heads(self) -> dict[str, int]:
        return {"linear-attention key heads": self.linear_num_key_heads,
                "linear-attention value heads": self.linear_num_value_heads}

    def ffn_widths(self) -> dict[str, int]:
        widths = {}
        if not all(self.is_sparse(i) for i in range(self.num_hidden_layers)):
            widths["down_proj"] = self.intermediate_size
        if self.num_experts:
            widths["experts' down_proj"] = self.moe_intermediate_size
            widths["shared expert's down_proj"] = self.shared_expert_intermediate_size
        return widths

    def row_parallel_widths(self) -> dict[str, int]:
        return {**super().row_parallel_widths(), "out_proj": self.linear_num_value_heads * self.linear_value_head_dim}


def _without_rope_layout(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """The multimodal-RoPE keys (and the rotary fraction, read on its own) are no scaling of the frequencies."""
    if scaling is None:
        return None
    rest = {k: v for k, v in scaling.items() if k not in ("mrope_section", "mrope_interleaved", "partial_rotary_factor")}
    return None if set(rest) <= {"rope_type"} else rest


class GatedAttention(Attention):
    """Grouped-query attention whose q_proj also gives a per-channel output gate: out * sigmoid(gate)."""

    def __init__(self, layer: int, args: ModelArgs, rope: RoPE | MRoPE | None = None):
        rotary_dims = int(args.head_dim * args.partial_rotary_factor)
        rope = rope or RoPE(rotary_dims, args.rope_theta, args.rope_scaling, args.max_position_embeddings)
        super().__init__(layer, args.hidden_size, args.num_attention_heads, args.num_key_value_heads, args.head_dim,
                         rope, bias=args.attention_bias, out_bias=args.attention_bias,
                         qk_norm=lambda dims: RMSNorm(dims, args.rms_norm_eps))
        self.q_proj = nn.Linear(args.hidden_size, 2 * args.num_attention_heads * args.head_dim, bias=args.attention_bias)

    def __call__(self, x: mx.array, positions: mx.array, attention: AttentionBackend) -> mx.array:
        N, _ = x.shape
        q, gate = mx.split(self.q_proj(x).reshape(N, self.num_heads, 2 * self.head_dim), 2, axis=-1)
        k = self.k_proj(x).reshape(N, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(N, self.num_kv_heads, self.head_dim)
        q, k = self.rope(self.q_norm(q), positions), self.rope(self.k_norm(k), positions)
        out = attention(self.layer, q, k, v, self.scale)
        return self.o_proj((out * kernels.sigmoid(gate)).reshape(N, -1))


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output, times silu(gate) (the gate: in_proj_z's projection)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps) * kernels.silu(gate.astype(mx.float32)).astype(x.dtype)


class GatedDeltaNet(nn.Module):
    """Linear attention with a gated delta rule; its state lives in the step's backend, per sequence."""

    def __init__(self, layer: int, args: ModelArgs):
        super().__init__()
        spec = args.recurrent_spec()
        self.layer = layer
        self.num_k_heads, self.num_v_heads = args.linear_num_key_heads, args.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = args.linear_key_head_dim, args.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        value_dim = self.num_v_heads * self.head_v_dim
        D = args.hidden_size
        self.in_proj_qkv = nn.Linear(D, spec.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(D, value_dim, bias=False)
        self.in_proj_b = nn.Linear(D, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(D, self.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(spec.conv_dim, spec.conv_dim, spec.kernel, groups=spec.conv_dim, bias=False)
        self.dt_bias = mx.ones((self.num_v_heads,))
        self.A_log = mx.zeros((self.num_v_heads,))
        self.norm = GatedRMSNorm(self.head_v_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(value_dim, D, bias=False)

    def shard(self, group: mx.distributed.Group, all_reduce: Callable[[mx.array], mx.array]) -> None:
        """Whole key heads per rank, each with the value heads it serves: q, k and v are cut per segment (the
        conv1d's channels follow them), z, a, b and the decay parameters by value head; the state is this
        rank's heads alone. One all-reduce after out_proj, as after attention's o_proj."""
        size, rank = group.size(), group.rank()
        segments = [self.key_dim, 2 * self.key_dim]  # q | k | v
        shard_inplace(self.in_proj_qkv, "all-to-sharded", segments=segments, group=group)
        shard_inplace(self.conv1d, lambda _path, _weight: (0, segments), group=group)  # weight [C, K, 1]
        for name in ("in_proj_z", "in_proj_b", "in_proj_a"):
            shard_output_features(self, name, group)
        per_rank = self.num_v_heads // size
        self.dt_bias, self.A_log = (p[rank * per_rank:(rank + 1) * per_rank] for p in (self.dt_bias, self.A_log))
        shard_input_features(self, "out_proj", group, all_reduce)
        self.num_k_heads //= size
        self.num_v_heads //= size
        self.key_dim //= size

    def __call__(self, x: mx.array, positions: mx.array, attention: AttentionBackend) -> mx.array:
        N, _ = x.shape
        H, Dk, Dv = self.num_v_heads, self.head_k_dim, self.head_v_dim
        mixed = kernels.silu(attention.conv1d(self.layer, self.in_proj_qkv(x), self.conv1d.weight[:, :, 0]))
        q, k, v = mx.split(mixed, [self.key_dim, 2 * self.key_dim], axis=-1)
        repeat = H // self.num_k_heads  # each key head serves `repeat` consecutive value heads
        q, k = (mx.repeat(_l2_normalized(t.reshape(N, self.num_k_heads, Dk)), repeat, axis=1) for t in (q, k))
        g = -mx.exp(self.A_log.astype(mx.float32)) * nn.softplus(self.in_proj_a(x).astype(mx.float32) + self.dt_bias)
        beta = kernels.sigmoid(self.in_proj_b(x).astype(mx.float32))
        out = attention.delta_rule(self.layer, q * Dk**-0.5, k, v.reshape(N, H, Dv).astype(mx.float32), g, beta)
        z = self.in_proj_z(x).reshape(N, H, Dv)
        return self.out_proj(self.norm(out.astype(x.dtype), z).reshape(N, -1))


def _l2_normalized(x: mx.array, eps: float = 1e-6) -> mx.array:
    x = x.astype(mx.float32)
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + eps)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, rope: RoPE | MRoPE | None = None):
        super().__init__()
        self.is_linear = args.layer_types[layer] == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(layer, args)
        else:
            self.self_attn = GatedAttention(layer, args, rope)
        act = activation(args.hidden_act)
        if args.is_sparse(layer):
            self.mlp = SharedExpertMoE(args.hidden_size, args.moe_intermediate_size, args.num_experts,
                                       args.num_experts_per_tok, args.norm_topk_prob,
                                       args.shared_expert_intermediate_size, act)
        else:
            self.mlp = MLP(args.hidden_size, args.intermediate_size, act)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    @property
    def mixer(self) -> GatedDeltaNet | GatedAttention:
        return self.linear_attn if self.is_linear else self.self_attn

    def __call__(self, x: mx.array, positions: mx.array, attention: AttentionBackend,
                 rows: mx.array | None = None) -> mx.array:
        h = only_rows(x + self.mixer(self.input_layernorm(x), positions, attention), rows)
        return h + self.mlp(self.post_attention_layernorm(h))

    def shard(self, group: mx.distributed.Group, all_reduce: Callable[[mx.array], mx.array]) -> None:
        self.mixer.shard(group, all_reduce)
        self.mlp.shard(group, all_reduce)


class Model(CausalLM):
    def __init__(self, args: ModelArgs, rope: MRoPE | None = None):
        """`rope`: the attention layers' multimodal one (qwen3_5_vl.py); plain RoPE without."""
        super().__init__(args)
        self.model = qwen2.Qwen2Model(args, [DecoderLayer(args, i, rope) for i in range(args.num_hidden_layers)])
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def layer_specs(self) -> tuple[LayerSpec, ...]:
        return self._specs(self.args, self.tensor_parallel_size)

    @classmethod
    def layer_specs_of(cls, args: ModelArgs) -> tuple[LayerSpec, ...]:
        return cls._specs(args, 1)

    @staticmethod
    def _specs(args: ModelArgs, ranks: int) -> tuple[LayerSpec, ...]:
        recurrent = args.recurrent_spec(ranks)
        return tuple(recurrent if t == LINEAR else FullAttention() for t in args.layer_types)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Text weights only (the vision tower and the MTP weights are never read), named as this module
        tree; Hugging Face's layout (conv1d [C, 1, K], norms as offsets) converted."""
        renamed = text_model_weights(weights, _NOT_TEXT)
        if _is_hf_layout(renamed):
            for name, value in renamed.items():
                if name.endswith("conv1d.weight"):
                    renamed[name] = value.moveaxis(2, 1)
                elif name.endswith(_OFFSET_NORMS):
                    renamed[name] = value + 1.0
        if self.args.num_experts:
            renamed = stack_experts(renamed, self.args.num_experts)
        return super().sanitize(renamed)

    def mtp_head(self, weights: dict[str, mx.array]) -> tuple[MTPBody | None, dict[str, mx.array]]:
        """The checkpoint's MTP head (models/mtp.py) and its weights named as its module tree, from every
        tensor of the checkpoint (whose layout tells whether its norms are offsets); no weights: (None, {})."""
        head = {name.split("mtp.", 1)[1]: value for name, value in weights.items()
                if name.startswith("mtp.") or ".mtp." in name}
        if not head:
            return None, {}
        if _is_hf_layout(weights):
            head = {name: value + 1.0 if name == "norm.weight" or name.endswith(_MTP_OFFSET_NORMS) else value
                    for name, value in head.items()}
        if self.args.num_experts:
            head = stack_experts(head, self.args.num_experts)
        num_layers = 1 + max((int(name.split(".")[1]) for name in head if name.startswith("layers.")), default=0)
        args = replace(self.args, num_hidden_layers=num_layers, layer_types=(hf_config.FULL,) * num_layers,
                       mlp_only_layers=())
        return MTPBody(args.hidden_size, args.rms_norm_eps, [DecoderLayer(args, i) for i in range(num_layers)]), head


def _is_hf_layout(weights: dict[str, mx.array]) -> bool:
    """Hugging Face's checkpoints store conv1d as [C, 1, K] (and norms as offsets); mlx-lm's as [C, K, 1]."""
    return any(name.endswith("conv1d.weight") and value.shape[-1] != 1 for name, value in weights.items())
