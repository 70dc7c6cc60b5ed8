"""A random checkpoint of gpt-oss's shapes, sized down to run on 2 CPU cores, for families.py.

gpt-oss-20b's architecture at a third of its width and half its depth: 12 layers of width 1024,
sliding-window (128) and full attention in turn, 16 query heads and 4 KV heads of 64 with sinks and
biases, YaRN RoPE as released (factor 32 over 4,096), a mixture of 32 experts of width 1024, top 4, with
the clamped SwiGLU; the experts in MXFP4 as gpt-oss is published (`*_blocks`, `*_scales`, a
quantization_config of quant_method mxfp4), everything else float32. The vocabulary is the carried
tokenizer's (tinymlx's offline Qwen2.5, 151,936 tokens: there is no o200k tokenizer offline), untied. Weights
are random (normal, std 0.02; MXFP4 codes uniform, e8m0 scales 2^-7 .. 2^-4; norms at 1), written once
to CHECKPOINT_DIR. Both engines load the directory as it is: mlx-lm reads the same layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import common
import numpy as np

CONFIG = {
    "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": 1024,
    "num_hidden_layers": 12, "intermediate_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 6, "rms_norm_eps": 1e-5, "swiglu_limit": 7.0,
    "attention_bias": True, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "rope_theta": 150000.0, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                             "beta_slow": 1.0, "truncate": False,
                                             "original_max_position_embeddings": 4096},
    "quantization_config": {"quant_method": "mxfp4"}, "torch_dtype": "float32",
    "eos_token_id": 151645,  # the carried tokenizer's <|im_end|>
}
CHECKPOINT_DIR = Path("~/.cache/tinymlx-bench/gpt-oss-shaped-random").expanduser()


def _layer(layer: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    c = CONFIG
    D, E, inter = c["hidden_size"], c["num_local_experts"], c["intermediate_size"]
    H, KV, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)

    p = f"model.layers.{layer}."
    out = {p + "input_layernorm.weight": np.ones(D, np.float32), p + "post_attention_layernorm.weight": np.ones(D, np.float32),
           p + "self_attn.sinks": normal(H) * 50, p + "mlp.router.weight": normal(E, D), p + "mlp.router.bias": normal(E),
           p + "mlp.experts.gate_up_proj_bias": normal(E, 2 * inter), p + "mlp.experts.down_proj_bias": normal(E, D)}
    for name, rows, cols in (("q_proj", H * hd, D), ("k_proj", KV * hd, D), ("v_proj", KV * hd, D), ("o_proj", D, H * hd)):
        out[p + f"self_attn.{name}.weight"], out[p + f"self_attn.{name}.bias"] = normal(rows, cols), normal(rows)
    for name, rows, cols in (("gate_up_proj", 2 * inter, D), ("down_proj", D, inter)):
        out[p + f"mlp.experts.{name}_blocks"] = rng.integers(0, 256, (E, rows, cols // 32, 16), dtype=np.uint8)
        out[p + f"mlp.experts.{name}_scales"] = rng.integers(120, 124, (E, rows, cols // 32), dtype=np.uint8)
    return out


def ensure_checkpoint(tokenizer_dir: Path, path: Path = CHECKPOINT_DIR) -> Path:
    """The random checkpoint, written on first use: the embedding, norm and lm_head, then a shard per layer."""
    rng = np.random.default_rng(0)
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    D = CONFIG["hidden_size"]

    def outer() -> dict[str, np.ndarray]:
        return {"model.embed_tokens.weight": rng.standard_normal((vocab, D), dtype=np.float32) * 0.02,
                "lm_head.weight": rng.standard_normal((vocab, D), dtype=np.float32) * 0.02,
                "model.norm.weight": np.ones(D, np.float32)}

    shards = [outer] + [lambda layer=layer: _layer(layer, rng) for layer in range(CONFIG["num_hidden_layers"])]
    return common.write_random_checkpoint(path, "gpt-oss-shaped", tokenizer_dir, {**CONFIG, "vocab_size": vocab},
                                          shards)
