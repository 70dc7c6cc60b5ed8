"""How llama.cpp's GGUF files spell a family: its `general.architecture`, tensor names and metadata keys.

Each family module declares one `GGUFArch` per architecture it reads (`GGUF_ARCHS`); the registry
collects them, and loader/gguf.py converts any of them with no table of its own:

    blk.3.attn_q.weight           -> model.layers.3.self_attn.q_proj.weight    (layer_tensors)
    token_embd / output_norm / output .weight -> embed_tokens / norm / lm_head (TOP_TENSORS, every arch)
    {arch}.embedding_length, ...  -> config.json                               (config(meta))

Names follow llama.cpp's gguf-py (`gguf.constants.TENSOR_NAMES`, `Keys`) and convert_hf_to_gguf.py.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

TOP_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
ATTENTION_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
QK_NORM_TENSORS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
MLP_TENSORS = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Pre-norm decoders (Llama, Qwen): attn_norm before attention, ffn_norm before the MLP.
PRE_NORM_TENSORS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# Gemma's sandwich norms: each block between a norm before it and a norm after it.
SANDWICH_NORM_TENSORS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                         "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}


class Metadata:
    """A GGUF's metadata for one architecture: `need`/`get` take keys without the `{arch}.` prefix.

    `need` raises KeyError naming the full key; `tensors` maps each tensor's name to its shape
    (as PyTorch orders it: slowest dimension first)."""

    def __init__(self, arch: str, fields: Mapping[str, Any], tensors: Mapping[str, tuple[int, ...]]):
        self.arch, self.fields, self.tensors = arch, fields, tensors

    def need(self, key: str) -> Any:
        if f"{self.arch}.{key}" not in self.fields:
            raise KeyError(f"{self.arch}.{key}")
        return self.fields[f"{self.arch}.{key}"]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(f"{self.arch}.{key}", default)

    def general(self, key: str, default: Any = None) -> Any:
        """A key outside the architecture's namespace (tokenizer.ggml.bos_token_id)."""
        return self.fields.get(key, default)


def f32(value: float) -> float:
    """GGUF stores floats as f32; keep the short value the model was published with (1e-06, not 9.99e-07)."""
    return float(str(np.float32(value)))


def dense_config(meta: Metadata, intermediate_size: int | None = None) -> dict[str, Any]:
    """config.json keys every llama.cpp decoder writes the same way: sizes, heads, norm eps, RoPE."""
    if "token_embd.weight" not in meta.tensors:
        raise KeyError("token_embd.weight")
    hidden, heads = meta.need("embedding_length"), meta.need("attention.head_count")
    head_dim = meta.get("attention.key_length") or meta.get("rope.dimension_count")
    config = {
        "hidden_size": hidden,
        "intermediate_size": meta.need("feed_forward_length") if intermediate_size is None else intermediate_size,
        "num_hidden_layers": meta.need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("attention.head_count_kv", heads),
        "head_dim": head_dim or hidden // heads,
        "rms_norm_eps": f32(meta.need("attention.layer_norm_rms_epsilon")),
        "rope_theta": f32(meta.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": meta.need("context_length"),
        "vocab_size": int(meta.tensors["token_embd.weight"][0]),
        "tie_word_embeddings": "output.weight" not in meta.tensors,
        "attention_bias": "blk.0.attn_q.bias" in meta.tensors,
        "hidden_act": "silu",
        "bos_token_id": meta.general("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.general("tokenizer.ggml.eos_token_id"),
    }
    scaling = meta.get("rope.scaling.type", "none")
    if scaling != "none":
        config["rope_scaling"] = {
            "type": scaling,
            "rope_type": scaling,
            "factor": f32(meta.get("rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": meta.get("rope.scaling.original_context_length"),
        }
    return config


@dataclass(frozen=True)
class GGUFArch:
    """One GGUF `general.architecture` and the Hugging Face checkpoint it converts to."""

    name: str  # general.architecture: "qwen2", "qwen3moe", "gemma3"
    hf_architecture: str  # config.json's architectures[0]
    model_type: str  # config.json's model_type: the registry's key
    layer_tensors: Mapping[str, str]  # blk.N.<gguf part> -> model.layers.N.<HF path>
    config: Callable[[Metadata], dict[str, Any]] = dense_config  # the family's config.json keys
    norm_shift: float = 0.0  # llama.cpp stored every *_norm weight plus this (Gemma's 1 + w): subtract it
    permute_qk: bool = False  # llama.cpp interleaved each head's Q/K rows for its pairwise RoPE (Llama only)
    top_tensors: Mapping[str, str] = field(default_factory=lambda: TOP_TENSORS)
    # blk.N.<gguf part>.<suffix> -> model.layers.N.<HF name>, whole: a parameter HF does not call weight or
    # bias (Gemma 4's layer_scalar), or a suffix llama.cpp gives one (its router's .scale)
    renamed: Mapping[str, str] = field(default_factory=dict)

    def hf_name(self, name: str) -> str | None:
        """The HF name of GGUF tensor `name` (None: not a tensor of this architecture)."""
        block, _, rest = name.partition(".")
        layer, _, part = rest.partition(".")
        if block == "blk" and layer.isdigit() and part in self.renamed:
            return f"model.layers.{layer}.{self.renamed[part]}"
        base, _, suffix = name.rpartition(".")
        if suffix not in ("weight", "bias"):
            return None
        if base in self.top_tensors:
            return f"{self.top_tensors[base]}.{suffix}"
        block, _, rest = base.partition(".")
        layer, _, part = rest.partition(".")
        if block != "blk" or not layer.isdigit() or part not in self.layer_tensors:
            return None
        return f"model.layers.{layer}.{self.layer_tensors[part]}.{suffix}"

    def is_norm(self, name: str) -> bool:
        """Whether GGUF tensor `name` is a norm's weight (what norm_shift applies to)."""
        return name.endswith("norm.weight")
