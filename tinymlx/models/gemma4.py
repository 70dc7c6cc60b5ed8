"""Gemma 4 (text): Gemma 3's sliding / global layers, plus what the E2B/E4B and the 26B/31B models add.

    attention:  q/k RMSNorm per head, v RMSNorm without a scale, scores scaled by 1; the global layers
                have their own width (`global_head_dim`, 512 where the sliding ones have 256) and
                "proportional" RoPE (a quarter of the pairs rotate); `attention_k_eq_v`: a global layer's
                values are its keys' projection (before the k norm and RoPE), with its own KV heads
    KV sharing: the last `num_kv_shared_layers` layers compute no K/V: each reads that of the last
                earlier layer of its type (core/layer_specs.py SharedKV), and with `use_double_wide_mlp`
                runs an MLP twice as wide
    per-layer inputs (PLE): a second embedding [vocab, layers * 256], plus a projection of the token's
                embedding, gives each layer a 256-wide input; the layer gates it with its output and
                adds it back, projected to the hidden size
    MoE block:  beside the dense MLP, a router (a scale-free RMSNorm, a learned scale, softmax, top k
                renormalized, a scale per expert) and experts run on the layer's input; both normed,
                summed, then normed again
    every layer's output is multiplied by its `layer_scalar`; logits are soft-capped.

Norms scale by w (not Gemma 3's 1 + w). model_type `gemma4` nests the text model's config in `text_config`
beside the vision and audio towers: gemma4_vl.py runs this model with the vision encoder; the audio tower is
not loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from tinymlx.core.layer_specs import FullAttention, LayerSpec, SharedKV, SlidingWindow
from tinymlx.core.pipeline_stage import PipelineStage, whole_model
from tinymlx.models import hf_config
from tinymlx.models.base import AttentionBackend, BaseModelArgs, CausalLM
from tinymlx.models.checkpoint import text_model_weights
from tinymlx.models.gguf_arch import (
    ATTENTION_TENSORS,
    MLP_TENSORS,
    QK_NORM_TENSORS,
    SANDWICH_NORM_TENSORS,
    TOP_TENSORS,
    GGUFArch,
    Metadata,
    dense_config,
    f32,
)
from tinymlx.models.layers import MLP, RMSNorm, activation, only_rows
from tinymlx.models.moe import SwitchMLP, mix_experts
from tinymlx.models.rope import RoPE
from tinymlx.models.sharding import shard_gated_mlp, shard_input_features, shard_output_features

_NOT_TEXT = tuple(f"{root}{tower}" for root in ("", "model.") for tower in (
    "vision_tower.", "audio_tower.", "embed_vision.", "embed_audio.", "multi_modal_projector.", "vision_embedder."))
_PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")  # what per_layer_config may change


@dataclass(frozen=True, kw_only=True)
class ModelArgs(BaseModelArgs):
    intermediate_size: int
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    rope: dict[str, dict[str, Any]] | None = None  # per layer type: rope_theta and the scaling (or None)
    layer_head_dims: tuple[int, ...] = ()  # each layer's head_dim (the global ones' differ)
    layer_kv_heads: tuple[int, ...] = ()
    hidden_size_per_layer_input: int = 0  # 0: no per-layer inputs
    vocab_size_per_layer_input: int = 0
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    enable_moe_block: bool = False
    num_experts: int = 0
    top_k_experts: int = 0
    moe_intermediate_size: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "layer_head_dims", tuple(self.layer_head_dims))
        object.__setattr__(self, "layer_kv_heads", tuple(self.layer_kv_heads))

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelArgs:
        if config.get("model_type") == "gemma4":  # the multimodal config: its text model only
            if "text_config" not in config:
                raise ValueError("a gemma4 config without a text_config has no text model to load (Gemma 4 "
                                 "runs here as its text model, with the vision encoder where it has one)")
            config = config["text_config"]
        if config.get("use_bidirectional_attention") == "all":
            raise ValueError("use_bidirectional_attention='all' (an encoder) is not supported")
        num_layers = config["num_hidden_layers"]
        types = list(hf_config.layer_types(
            config, lambda i: hf_config.SLIDING if (i + 1) % 6 else hf_config.FULL))
        types[-1] = hf_config.FULL  # transformers forces the last layer global
        head_dims, kv_heads = _per_layer_shapes(config, types)
        rope = {}
        params = config.get("rope_parameters") or _DEFAULT_ROPE
        for layer_type in set(types):
            theta, scaling = hf_config.rope_for({"rope_parameters": params}, layer_type,
                                                _DEFAULT_ROPE[layer_type]["rope_theta"])
            rope[layer_type] = {"theta": theta, "scaling": scaling}
        shared = config.get("num_kv_shared_layers", 0)
        if shared >= num_layers:
            raise ValueError(f"num_kv_shared_layers={shared} leaves no layer computing K/V for them")
        moe = config.get("enable_moe_block", False)
        per_layer = config.get("hidden_size_per_layer_input") or 0
        return cls(
            model_type="gemma4_text", **hf_config.dense_shape(config),
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            hidden_activation=config.get("hidden_activation", "gelu_pytorch_tanh"),
            final_logit_softcapping=config.get("final_logit_softcapping"),
            tie_word_embeddings=config.get("tie_word_embeddings", True),
            attention_bias=config.get("attention_bias", False),
            max_position_embeddings=config.get("max_position_embeddings", 131_072),
            layer_types=tuple(types), sliding_window=hf_config.sliding_window(config, tuple(types)),
            rope=rope, layer_head_dims=head_dims, layer_kv_heads=kv_heads,
            hidden_size_per_layer_input=per_layer,
            vocab_size_per_layer_input=config["vocab_size_per_layer_input"] if per_layer else 0,
            attention_k_eq_v=config.get("attention_k_eq_v", False), num_kv_shared_layers=shared,
            use_double_wide_mlp=config.get("use_double_wide_mlp", False), enable_moe_block=moe,
            num_experts=config["num_experts"] if moe else 0, top_k_experts=config["top_k_experts"] if moe else 0,
            moe_intermediate_size=config["moe_intermediate_size"] if moe else 0,
        )

    @property
    def first_shared_layer(self) -> int:
        return self.num_hidden_layers - self.num_kv_shared_layers

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V `layer` reads: itself, or for a KV-shared layer the last earlier layer of its
        type that computes its own (transformers' kv_sharing_modes: "reuse" reads what "store" kept)."""
        if layer < self.first_shared_layer:
            return layer
        kind = self.layer_types[layer]
        sources = [i for i in range(self.first_shared_layer) if self.layer_types[i] == kind]
        if not sources:
            raise ValueError(f"layer {layer} shares the K/V of a {kind} layer, and no earlier layer is one")
        return sources[-1]

    def mlp_width(self, layer: int) -> int:
        shared = layer >= self.first_shared_layer and self.num_kv_shared_layers > 0
        return self.intermediate_size * (2 if self.use_double_wide_mlp and shared else 1)

    def ffn_widths(self) -> dict[str, int]:
        widths = {"down_proj": self.intermediate_size}
        if self.enable_moe_block:
            widths["experts' down_proj"] = self.moe_intermediate_size
        return widths

    def whole_heads(self) -> dict[str, int]:
        return {f"KV heads of {kv}-head layers": kv for kv in set(self.layer_kv_heads) - {self.num_key_value_heads}}

    def row_parallel_widths(self) -> dict[str, int]:
        widths = {f"o_proj of head_dim {d}": self.num_attention_heads * d for d in sorted(set(self.layer_head_dims))}
        return {**widths, **self.ffn_widths()}


_DEFAULT_ROPE = {hf_config.SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                 hf_config.FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                  "rope_theta": 1_000_000.0}}


def _per_layer_shapes(config: dict[str, Any], types: list[str]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each layer's (head_dim, KV heads): transformers 5.x writes the global layers' as per_layer_config
    {"3": {"head_dim": 512}}; earlier configs (and mlx-lm's) as global_head_dim and, with
    attention_k_eq_v, num_global_key_value_heads."""
    head_dim, kv_heads = hf_config.heads(config)["head_dim"], hf_config.heads(config)["num_key_value_heads"]
    overrides = config.get("per_layer_config")
    if overrides is None:
        global_kv = config.get("num_global_key_value_heads") if config.get("attention_k_eq_v") else None
        global_shape = {"head_dim": config.get("global_head_dim", 512), "num_key_value_heads": global_kv or kv_heads}
        overrides = {i: global_shape for i, t in enumerate(types) if t == hf_config.FULL}
    overrides = {int(layer): shape for layer, shape in overrides.items()}
    for layer, shape in overrides.items():
        unknown = sorted(set(shape) - set(_PER_LAYER_KEYS))
        if unknown:
            raise ValueError(f"per_layer_config sets {unknown} for layer {layer}; only {list(_PER_LAYER_KEYS)} "
                             "may differ between layers")
    return (tuple(overrides.get(i, {}).get("head_dim", head_dim) for i in range(len(types))),
            tuple(overrides.get(i, {}).get("num_key_value_heads", kv_heads) for i in range(len(types))))


class Attention(nn.Module):
    """Gemma 4's attention over flat tokens: q/k/v norms, scale 1; a KV-shared layer has only q and o and
    hands the backend no K/V (it reads its source's); `k_eq_v`: the values are the keys' projection."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = args.num_attention_heads, args.layer_kv_heads[layer]
        self.head_dim = head_dim = args.layer_head_dims[layer]
        kind = args.layer_types[layer]
        self.is_shared = args.kv_source(layer) != layer
        self.k_eq_v = args.attention_k_eq_v and kind == hf_config.FULL
        bias, dim = args.attention_bias, args.hidden_size
        self.q_proj = nn.Linear(dim, self.num_heads * head_dim, bias=bias)
        self.q_norm = RMSNorm(head_dim, args.rms_norm_eps)
        if not self.is_shared:
            self.k_proj = nn.Linear(dim, self.num_kv_heads * head_dim, bias=bias)
            if not self.k_eq_v:
                self.v_proj = nn.Linear(dim, self.num_kv_heads * head_dim, bias=bias)
            self.k_norm = RMSNorm(head_dim, args.rms_norm_eps)
        self.o_proj = nn.Linear(self.num_heads * head_dim, dim, bias=bias)
        self.eps = args.rms_norm_eps
        rope = args.rope[kind]
        self.rope = RoPE(head_dim, rope["theta"], rope["scaling"], args.max_position_embeddings)

    def __call__(self, x: mx.array, positions: mx.array, attention: AttentionBackend) -> mx.array:
        N, _ = x.shape
        q = self.rope(self.q_norm(self.q_proj(x).reshape(N, self.num_heads, self.head_dim)), positions)
        k = v = None
        if not self.is_shared:
            k = self.k_proj(x).reshape(N, self.num_kv_heads, self.head_dim)
            v = k if self.k_eq_v else self.v_proj(x).reshape(N, self.num_kv_heads, self.head_dim)
            k = self.rope(self.k_norm(k), positions)
            v = mx.fast.rms_norm(v, None, self.eps)  # v_norm: no scale
        out = attention(self.layer, q, k, v, 1.0)
        return self.o_proj(out.reshape(N, -1))

    def shard(self, group: mx.distributed.Group, all_reduce: Callable[[mx.array], mx.array]) -> None:
        """Whole heads per rank (the norms act per head and stay whole); one all-reduce after o_proj."""
        for name in ("q_proj", "k_proj", "v_proj"):
            if name in self:
                shard_output_features(self, name, group)
        self.num_heads //= group.size()
        self.num_kv_heads //= group.size()
        shard_input_features(self, "o_proj", group, all_reduce)


class Router(nn.Module):
    """Softmax over the experts of a scale-free RMSNorm of x, times `scale` / sqrt(hidden); the top k
    renormalized, each times its expert's `per_expert_scale`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.proj = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.scale = mx.ones((args.hidden_size,))
        self.per_expert_scale = mx.ones((args.num_experts,))
        self.top_k, self.eps, self.root = args.top_k_experts, args.rms_norm_eps, args.hidden_size**-0.5

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        h = mx.fast.rms_norm(x, None, self.eps) * self.scale * self.root
        probs = mx.softmax(self.proj(h).astype(mx.float32), axis=-1, precise=True)
        experts = mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[:, :self.top_k]
        scores = mx.take_along_axis(probs, experts, axis=-1)
        scores = scores / scores.sum(axis=-1, keepdims=True)
        return experts, scores * self.per_expert_scale[experts]


class Experts(nn.Module):
    """The routed experts (mlx-lm's `switch_glu` names), batched through gather_mm (moe.py)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.switch_glu = SwitchMLP(args.hidden_size, args.moe_intermediate_size, args.num_experts,
                                    activation(args.hidden_activation))
        self._all_reduce: Callable[[mx.array], mx.array] | None = None

    def __call__(self, x: mx.array, experts: mx.array, scores: mx.array) -> mx.array:
        out = mix_experts(self.switch_glu, x, experts, scores)
        return out if self._all_reduce is None else self._all_reduce(out)

    def shard(self, group: mx.distributed.Group, all_reduce: Callable[[mx.array], mx.array]) -> None:
        """Every expert's FFN split like a dense MLP (the router stays whole: every rank routes alike); its
        own all-reduce, since its output is normed before it meets the dense MLP's."""
        shard_gated_mlp(self.switch_glu, group)
        self._all_reduce = all_reduce


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        act = activation(args.hidden_activation)
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args.hidden_size, args.mlp_width(layer), act)

        def norm() -> RMSNorm:
            return RMSNorm(args.hidden_size, args.rms_norm_eps)

        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        if args.enable_moe_block:
            self.router, self.experts = Router(args), Experts(args)
            self.post_feedforward_layernorm_1, self.post_feedforward_layernorm_2 = norm(), norm()
            self.pre_feedforward_layernorm_2 = norm()
        if args.hidden_size_per_layer_input:
            self.per_layer_input_gate = nn.Linear(args.hidden_size, args.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(args.hidden_size_per_layer_input, args.hidden_size, bias=False)
            self.post_per_layer_input_norm = norm()
        self.layer_scalar = mx.ones((1,))
        self.act = act

    def __call__(self, x: mx.array, positions: mx.array, attention: AttentionBackend, per_layer_input: mx.array | None,
                 rows: mx.array | None = None) -> mx.array:
        h = only_rows(x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, attention)),
                      rows)
        out = self.mlp(self.pre_feedforward_layernorm(h))
        if "router" in self:  # the experts read the layer's input beside the dense MLP
            experts, scores = self.router(h)
            routed = self.experts(self.pre_feedforward_layernorm_2(h), experts, scores)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(routed)
        h = h + self.post_feedforward_layernorm(out)
        if per_layer_input is not None:
            gated = self.act(self.per_layer_input_gate(h), only_rows(per_layer_input, rows))
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return h * self.layer_scalar

    def shard(self, group: mx.distributed.Group, all_reduce: Callable[[mx.array], mx.array]) -> None:
        """Attention, the dense MLP and the experts split; the per-layer input's gate and projection stay
        whole (256 wide: each rank computes them for its whole residual)."""
        self.self_attn.shard(group, all_reduce)
        self.mlp.shard(group, all_reduce)
        if "experts" in self:
            self.experts.shard(group, all_reduce)


class Gemma4Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.stage = whole_model(args.num_hidden_layers)  # a pipeline stage's (CausalLM.keep_stage)
        if args.hidden_size_per_layer_input:
            width = args.num_hidden_layers * args.hidden_size_per_layer_input
            self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, width)
            self.per_layer_model_projection = nn.Linear(args.hidden_size, width, bias=False)
            self.per_layer_projection_norm = RMSNorm(args.hidden_size_per_layer_input, args.rms_norm_eps)

    def embed(self, tokens: mx.array) -> mx.array:
        h = self.embed_tokens(tokens)
        return h * mx.array(self.args.hidden_size**0.5, dtype=h.dtype)  # rounded to the activation dtype, as HF does

    def __call__(self, tokens: mx.array, positions: mx.array, attention: AttentionBackend,
                 rows: mx.array | None = None, embeds: mx.array | None = None,
                 per_layer_tokens: mx.array | None = None) -> mx.array:
        """`embeds`: the tokens' scaled input embeddings where the caller made them (image rows put in); on a
        pipeline stage after the first, the stage before's hand-off (`_hand_off`). `per_layer_tokens`: the ids
        the per-layer embedding looks up, where they are not `tokens`. A stage before the last returns its
        hand-off: every row's hidden states before the norm, and the per-layer inputs the later layers need."""
        if self.stage.is_first:
            h = self.embed(tokens) if embeds is None else embeds
            per_layer = self._per_layer_inputs(tokens if per_layer_tokens is None else per_layer_tokens, h)
        else:
            h, per_layer = self._taken_over(embeds)
        *inner, last = self.stage.layers
        for i in inner:
            h = self.layers[i](h, positions, attention, None if per_layer is None else per_layer[:, i])
        last_rows = rows if self.stage.is_last else None
        h = self.layers[last](h, positions, attention, None if per_layer is None else per_layer[:, last], last_rows)
        return self.norm(h) if self.stage.is_last else self._hand_off(h, per_layer)

    def _hand_off(self, h: mx.array, per_layer: mx.array | None) -> mx.array:
        """[N, hidden (+ layers x per-layer width)]: one array between stages, the per-layer inputs beside h."""
        if per_layer is None:
            return h
        return mx.concatenate([h, per_layer.reshape(h.shape[0], -1).astype(h.dtype)], axis=1)

    def _taken_over(self, hand_off: mx.array) -> tuple[mx.array, mx.array | None]:
        h = hand_off[:, :self.args.hidden_size]
        if not self.args.hidden_size_per_layer_input:
            return h, None
        shape = (hand_off.shape[0], self.args.num_hidden_layers, self.args.hidden_size_per_layer_input)
        return h, hand_off[:, self.args.hidden_size:].reshape(shape)

    def _per_layer_inputs(self, tokens: mx.array, h: mx.array) -> mx.array | None:
        """[N, layers, width]: the token's per-layer embedding and a projection of its embedding, averaged
        (times 1/sqrt 2, as transformers does)."""
        if "embed_tokens_per_layer" not in self:
            return None
        args = self.args
        shape = (tokens.shape[0], args.num_hidden_layers, args.hidden_size_per_layer_input)
        embedded = self.embed_tokens_per_layer(tokens)
        embedded = (embedded * mx.array(args.hidden_size_per_layer_input**0.5, dtype=embedded.dtype)).reshape(shape)
        projected = self.per_layer_model_projection(h) * args.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        return (projected + embedded) * 2**-0.5


class Model(CausalLM):

    def __init__(self, args: ModelArgs):
        if args.sliding_window is None and hf_config.SLIDING in args.layer_types:
            raise ValueError("sliding layers need a sliding_window")
        super().__init__(args)
        self.model = Gemma4Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def keep_stage(self, stage: PipelineStage) -> None:
        """The per-layer inputs are made on the first stage, from its embeddings, and handed on."""
        super().keep_stage(stage)
        if not stage.is_first and self.args.hidden_size_per_layer_input:
            inner = self.model
            del inner.embed_tokens_per_layer, inner.per_layer_model_projection, inner.per_layer_projection_norm

    @classmethod
    def layer_specs_of(cls, args: ModelArgs) -> tuple[LayerSpec, ...]:
        """Sliding and global layers each with their own K/V shape; the KV-shared ones read their source's."""
        specs: list[LayerSpec] = []
        for layer, kind in enumerate(args.layer_types):
            source = args.kv_source(layer)
            if source != layer:
                specs.append(SharedKV(source))
            elif kind == hf_config.SLIDING:
                specs.append(SlidingWindow(args.sliding_window, args.layer_kv_heads[layer], args.layer_head_dims[layer]))
            elif kind == hf_config.FULL:
                specs.append(FullAttention(args.layer_kv_heads[layer], args.layer_head_dims[layer]))
            else:
                raise ValueError(f"layer type {kind!r} is not supported by {cls.__module__}")
        return tuple(specs)

    def logits(self, hidden: mx.array) -> mx.array:
        logits = super().logits(hidden)
        cap = self.args.final_logit_softcapping
        return logits if cap is None else mx.tanh(logits / cap) * cap

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """The text model of a gemma4 checkpoint (towers dropped); a KV-shared layer's K/V weights, which
        transformers ignores too, dropped; the experts' fused gate_up_proj [E, 2I, D] split (gate first)."""
        out = {}
        for name, value in text_model_weights(weights, _NOT_TEXT).items():
            if name.startswith(_GGUF_ROPE_FREQS):  # llama.cpp's proportional RoPE as a tensor; ours computes it
                continue
            prefix, _, part = name.partition(".self_attn.")
            if part.partition(".")[0] in ("k_proj", "v_proj", "k_norm", "v_norm") and _is_shared(self.args, prefix):
                continue
            if name.endswith(".experts.gate_up_proj"):
                gate, up = mx.split(value, 2, axis=1)
                out[f"{name.removesuffix('gate_up_proj')}switch_glu.gate_proj.weight"] = mx.contiguous(gate)
                out[f"{name.removesuffix('gate_up_proj')}switch_glu.up_proj.weight"] = mx.contiguous(up)
            elif name.endswith(".experts.down_proj"):
                out[f"{name.removesuffix('down_proj')}switch_glu.down_proj.weight"] = value
            else:
                out[name] = value
        return super().sanitize(out)


def _is_shared(args: ModelArgs, prefix: str) -> bool:
    layer = prefix.rpartition(".")[2]
    return layer.isdigit() and args.kv_source(int(layer)) != int(layer)


# -- llama.cpp's gemma4 (convert_hf_to_gguf.py's Gemma4Model: the text model of Gemma4ForConditionalGeneration)
_GGUF_ROPE_FREQS = "rope_freqs"
_GGUF_PARTIAL_ROTARY = 0.25  # of the global layers: a file holds it only as rope_freqs' values, 0.25 in every Gemma 4


def _gguf_config(meta: Metadata) -> dict[str, Any]:
    """config.json from llama.cpp's gemma4 keys: per-layer arrays (feed_forward_length where KV-shared layers
    run a double-wide MLP, head_count_kv where the global layers have their own), the sliding pattern as a
    flag per layer, the widths of both layer types, and the pieces the tensors imply (k_eq_v: global layers
    without attn_v; the MoE block: a router)."""
    widths = meta.need("feed_forward_length")
    widths = widths if isinstance(widths, list) else [widths] * meta.need("block_count")
    config = dense_config(meta, intermediate_size=int(widths[0]))
    num_layers, tensors = config["num_hidden_layers"], meta.tensors
    pattern = meta.need("attention.sliding_window_pattern")
    types = [hf_config.SLIDING if slides else hf_config.FULL for slides in pattern]
    kv_heads = meta.get("attention.head_count_kv", config["num_attention_heads"])
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * num_layers
    full = types.index(hf_config.FULL)
    sliding = types.index(hf_config.SLIDING) if hf_config.SLIDING in types else full
    head_dim_swa = meta.get("attention.key_length_swa", config["head_dim"])
    shared = meta.get("attention.shared_kv_layers", 0)
    per_layer = meta.get("embedding_length_per_layer_input", 0)
    softcap = meta.get("final_logit_softcapping")
    rope_swa = {"rope_type": "default", "rope_theta": f32(meta.get("rope.freq_base_swa", 10_000.0))}
    rotated_swa = meta.get("rope.dimension_count_swa", head_dim_swa)
    if rotated_swa != head_dim_swa:
        rope_swa["partial_rotary_factor"] = rotated_swa / head_dim_swa
    config.update(
        model_type="gemma4_text", hidden_activation="gelu_pytorch_tanh", layer_types=types,
        sliding_window=meta.need("attention.sliding_window"), head_dim=head_dim_swa,
        global_head_dim=meta.need("attention.key_length"), num_key_value_heads=kv_heads[sliding],
        attention_k_eq_v=f"blk.{full}.attn_v.weight" not in tensors, num_global_key_value_heads=kv_heads[full],
        num_kv_shared_layers=shared, use_double_wide_mlp=shared > 0 and widths[-1] == 2 * widths[0],
        hidden_size_per_layer_input=per_layer,
        vocab_size_per_layer_input=int(tensors["per_layer_token_embd.weight"][0]) if per_layer else None,
        final_logit_softcapping=None if softcap is None else f32(softcap),
        rope_parameters={hf_config.SLIDING: rope_swa,
                         hf_config.FULL: {"rope_type": "proportional", "partial_rotary_factor": _GGUF_PARTIAL_ROTARY,
                                          "rope_theta": config["rope_theta"]}},
    )
    if "blk.0.ffn_gate_inp.weight" in tensors:
        config.update(enable_moe_block=True, num_experts=meta.need("expert_count"),
                      top_k_experts=meta.need("expert_used_count"),
                      moe_intermediate_size=meta.need("expert_feed_forward_length"))
    return config


GGUF_LAYER_TENSORS = {
    **SANDWICH_NORM_TENSORS,
    "post_ffw_norm_1": "post_feedforward_layernorm_1",
    "post_ffw_norm_2": "post_feedforward_layernorm_2",
    "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
    "inp_gate": "per_layer_input_gate",
    "proj": "per_layer_projection",
    "post_norm": "post_per_layer_input_norm",
    "ffn_gate_inp": "router.proj",
    **ATTENTION_TENSORS,
    **QK_NORM_TENSORS,
    **MLP_TENSORS,
}
GGUF_ARCHS = (GGUFArch(
    "gemma4", "Gemma4ForCausalLM", "gemma4_text", GGUF_LAYER_TENSORS, _gguf_config,
    top_tensors={**TOP_TENSORS, "per_layer_token_embd": "model.embed_tokens_per_layer",
                 "per_layer_model_proj": "model.per_layer_model_projection",
                 "per_layer_proj_norm": "model.per_layer_projection_norm", _GGUF_ROPE_FREQS: _GGUF_ROPE_FREQS},
    renamed={"layer_output_scale.weight": "layer_scalar", "ffn_gate_up_exps.weight": "experts.gate_up_proj",
             "ffn_down_exps.weight": "experts.down_proj", "ffn_gate_inp.scale": "router.scale",
             "ffn_down_exps.scale": "router.per_expert_scale"}),)
