"""Tiny random hybrid checkpoints (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) written by transformers, shared by
the hybrid tests (torch and transformers are imported by the caller's test first)."""

from __future__ import annotations

import copy
from pathlib import Path

TEXT = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
VARIANTS = {  # name: (transformers config class, its arguments)
    "qwen3_5_text": ("Qwen3_5TextConfig", TEXT),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", {**TEXT, **MOE}),
    "qwen3_next": ("Qwen3NextConfig", {**TEXT, **MOE, "mlp_only_layers": [1]}),
    # The released layout: the text model under model.language_model, beside a vision tower (loaded: models/qwen3_5_vl.py).
    "qwen3_5": ("Qwen3_5Config", {"text_config": TEXT, "vision_config": VISION, "image_token_id": 299,
                                  "video_token_id": 298, "vision_start_token_id": 297, "vision_end_token_id": 296}),
}


def hf_checkpoint(path: Path, variant: str, seed: int = 0, std: float = 0.2, **overrides):
    """A random transformers model of `variant`, saved (float32 safetensors) to `path`; returns the model."""
    config_class, arguments = VARIANTS[variant]
    import torch
    import transformers

    config = getattr(transformers, config_class)(**copy.deepcopy({**arguments, **overrides}))
    config._attn_implementation = "eager"
    model_class = transformers.Qwen3_5ForConditionalGeneration if variant == "qwen3_5" else transformers.AutoModelForCausalLM
    model = model_class.from_config(config) if model_class is transformers.AutoModelForCausalLM else model_class(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # beyond HF's tiny init, so every term matters
            param.normal_(0, std)
            if name.endswith("A_log"):  # decays from e^-0.4 to e^-2.7 per token: the state matters, and fades
                param.uniform_(-1.0, 1.0)
    model.eval()
    model.save_pretrained(path)
    return model
