"""A random checkpoint of Gemma 4 E2B's shapes, sized down to run on 2 CPU cores, for families.py.

Gemma-4-E2B's structure at a third of its width and under half its depth: 15 layers of width 512, four
sliding-window (512) layers then a global one, 4 query heads and 1 KV head, 256 wide on the sliding layers
and 512 on the global ones (proportional RoPE, a quarter rotating), q/k/v norms; the last 8 layers share the
K/V of the last earlier layer of their type (E2B: 20 of 35) and run double-wide MLPs (2 x 2048); per-layer
inputs of 64 per layer (E2B: 256) from a second embedding; logits soft-capped at 30. The vocabulary is the
carried tokenizer's (tinymlx's offline Qwen2.5, 151,936 tokens), tied. Weights are random (normal, std
0.02; norms and layer scalars at 1), float32, written once to CHECKPOINT_DIR in Hugging Face's names, with
the keys both engines read (global_head_dim for mlx-lm's gemma4_text, which has no per_layer_config).
"""

from __future__ import annotations

import json
from pathlib import Path

import common
import numpy as np

LAYERS, SHARED, PER_LAYER = 15, 8, 64
CONFIG = {
    "model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"], "hidden_size": 512,
    "num_hidden_layers": LAYERS, "intermediate_size": 2048, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "global_head_dim": 512, "sliding_window": 512,
    "layer_types": ["sliding_attention" if (i + 1) % 5 else "full_attention" for i in range(LAYERS)],
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1000000.0}},
    "num_kv_shared_layers": SHARED, "use_double_wide_mlp": True, "hidden_size_per_layer_input": PER_LAYER,
    "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "tie_word_embeddings": True, "attention_k_eq_v": False,
    "enable_moe_block": False, "torch_dtype": "float32",
    "eos_token_id": 151645,  # the carried tokenizer's <|im_end|>
}
CHECKPOINT_DIR = Path("~/.cache/tinymlx-bench/gemma4-e2b-shaped-random").expanduser()


def _layer(layer: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    c = CONFIG
    D, H = c["hidden_size"], c["num_attention_heads"]
    is_global = c["layer_types"][layer] == "full_attention"
    hd = c["global_head_dim"] if is_global else c["head_dim"]
    shared = layer >= LAYERS - SHARED
    inter = c["intermediate_size"] * (2 if shared else 1)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * 0.02

    p = f"model.layers.{layer}."
    out = {p + f"{norm}.weight": np.ones(D, np.float32) for norm in (
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
        "post_per_layer_input_norm")}
    out[p + "layer_scalar"] = np.ones(1, np.float32)
    out[p + "self_attn.q_norm.weight"] = np.ones(hd, np.float32)
    projections = [("q_proj", H * hd, D), ("o_proj", D, H * hd)]
    if not shared:
        out[p + "self_attn.k_norm.weight"] = np.ones(hd, np.float32)
        projections += [("k_proj", hd, D), ("v_proj", hd, D)]
    for name, rows, cols in projections:
        out[p + f"self_attn.{name}.weight"] = normal(rows, cols)
    for name, rows, cols in (("gate_proj", inter, D), ("up_proj", inter, D), ("down_proj", D, inter)):
        out[p + f"mlp.{name}.weight"] = normal(rows, cols)
    out[p + "per_layer_input_gate.weight"] = normal(PER_LAYER, D)
    out[p + "per_layer_projection.weight"] = normal(D, PER_LAYER)
    return out


def ensure_checkpoint(tokenizer_dir: Path, path: Path = CHECKPOINT_DIR) -> Path:
    """The random checkpoint, written on first use: the embeddings and norms, then a shard per layer."""
    rng = np.random.default_rng(0)
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    D = CONFIG["hidden_size"]

    def outer() -> dict[str, np.ndarray]:
        return {"model.embed_tokens.weight": rng.standard_normal((vocab, D), dtype=np.float32) * 0.02,
                "model.embed_tokens_per_layer.weight": rng.standard_normal((vocab, LAYERS * PER_LAYER),
                                                                           dtype=np.float32) * 0.02,
                "model.per_layer_model_projection.weight": rng.standard_normal((LAYERS * PER_LAYER, D),
                                                                               dtype=np.float32) * 0.02,
                "model.per_layer_projection_norm.weight": np.ones(PER_LAYER, np.float32),
                "model.norm.weight": np.ones(D, np.float32)}

    shards = [outer] + [lambda layer=layer: _layer(layer, rng) for layer in range(LAYERS)]
    config = {**CONFIG, "vocab_size": vocab, "vocab_size_per_layer_input": vocab}
    return common.write_random_checkpoint(path, "Gemma-4-E2B-shaped", tokenizer_dir, config, shards)
