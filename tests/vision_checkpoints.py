"""Tiny random vision-language checkpoints written by transformers, with the byte tokenizer plus the vision
tokens and a chat template that writes them, and test images drawn with Pillow."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tiny_models import byte_tokenizer_backend

VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = 257, 258, 259, 260
BOI, EOI, IMAGE_SOFT = 261, 262, 263  # Gemma's <start_of_image>, <end_of_image>, <image_soft_token>
GEMMA4_BOI, GEMMA4_EOI, GEMMA4_IMAGE = 264, 265, 266  # Gemma 4's <|image>, <image|>, <|image|>
SPECIAL_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>",
                  "<start_of_image>", "<end_of_image>", "<image_soft_token>", "<|image>", "<image|>", "<|image|>"]
VOCAB = 300
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
GEMMA_IMAGE = "<start_of_image>"
GEMMA4_IMAGE_MARKUP = "<|image|>"  # one per image: the model expands it (transformers' processor does)
# Qwen2-VL's (or Gemma's) template's way with content parts, on the byte tokenizer's plain turns.
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for p in m.content %}{% if p.type == 'image' %}IMAGE"
            "{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}<assistant>")
QWEN_PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2,
                     "temporal_patch_size": 2, "min_pixels": 3136, "max_pixels": 28 * 28 * 40,
                     "image_mean": [0.48145466, 0.4578275, 0.40821073],
                     "image_std": [0.26862954, 0.26130258, 0.27577711]}


def save_vision_tokenizer(path: Path, image_markup: str = QWEN_IMAGE) -> None:
    tokenizer = byte_tokenizer_backend()
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    tokenizer.save(str(path / "tokenizer.json"))
    template = TEMPLATE.replace("IMAGE", image_markup)
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": template}))


def _redraw(model, std: float, keep: tuple[str, ...]) -> None:
    """Weights beyond HF's tiny init, so every term matters; norms (ending in `keep`) as initialised."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith(keep):
                param.normal_(0, std)
    model.eval()


def qwen2_5_vl_checkpoint(path: Path, seed: int = 0, std: float = 0.1):
    """A random Qwen2.5-VL (2 text layers, a 4-block ViT with windows and full attention), saved in float32
    with the tokenizer and preprocessor config; returns the transformers model."""
    import torch
    import transformers

    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "type": "mrope", "mrope_section": [2, 3, 3],
                                          "rope_theta": 10000.0}),
        vision_config=dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           fullatt_block_indexes=[1, 3], window_size=56, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2),
        image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    _redraw(model, std, ("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight"))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    save_vision_tokenizer(path)
    (path / "preprocessor_config.json").write_text(json.dumps(QWEN_PREPROCESSOR))
    return model


GEMMA3_PREPROCESSOR = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 56, "width": 56},
                       "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2,
                       "do_pan_and_scan": False}


def gemma3_vl_checkpoint(path: Path, seed: int = 0, std: float = 0.1):
    """A random Gemma 3 with its SigLIP tower (56-pixel images: 16 patches pooled to 4 tokens), sliding and
    global layers, saved in float32 with the tokenizer and preprocessor config; returns the transformers model."""
    import torch
    import transformers

    config = transformers.Gemma3Config(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                         layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                         max_position_embeddings=2048, query_pre_attn_scalar=16),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=56, patch_size=14),
        mm_tokens_per_image=4, image_token_index=IMAGE_SOFT, boi_token_index=BOI, eoi_token_index=EOI)
    config._attn_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    _redraw(model, std, ("norm.weight", "layernorm.weight", "mm_soft_emb_norm.weight"))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    save_vision_tokenizer(path, GEMMA_IMAGE)
    (path / "preprocessor_config.json").write_text(json.dumps(GEMMA3_PREPROCESSOR))
    return model


# Qwen3-VL's and Qwen3.5's processor: 16-pixel patches, merged 2 x 2 (32-pixel windows), mean and std 0.5.
QWEN3_PREPROCESSOR = {**QWEN_PREPROCESSOR, "patch_size": 16, "min_pixels": 32 * 32, "max_pixels": 32 * 32 * 24,
                      "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
QWEN3_VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                    temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64)  # an 8 x 8 table
QWEN3_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)  # 2 x 48 != 64: the layout shows
QWEN3_VL_VARIANTS = {  # name: (transformers config and model classes, text config, vision config)
    # 3 layers, DeepStack after the first two; the MoE one has 2 (the last layer takes a level too) and a
    # dense layer among the sparse ones. Interleaved M-RoPE over head_dim 16's 8 pairs.
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration",
                 dict(QWEN3_TEXT, num_hidden_layers=3, head_dim=16),
                 dict(QWEN3_VISION, deepstack_visual_indexes=[0, 1])),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration",
                     dict(QWEN3_TEXT, **MOE, num_hidden_layers=2, head_dim=16, mlp_only_layers=[1]),
                     dict(QWEN3_VISION, deepstack_visual_indexes=[0, 2])),
    # Gated DeltaNet and gated attention layers; a quarter of head_dim 64 rotates (8 pairs).
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration",
                dict(QWEN3_TEXT, num_hidden_layers=4, head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=8,
                     linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                     layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
                QWEN3_VISION),
}
QWEN3_VL_VARIANTS["qwen3_5_moe"] = ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration",
                                    dict(QWEN3_VL_VARIANTS["qwen3_5"][2], **MOE, shared_expert_intermediate_size=48),
                                    QWEN3_VISION)


def qwen3_vl_checkpoint(path: Path, variant: str = "qwen3_vl", seed: int = 0, std: float = 0.1):
    """A random Qwen3-VL / Qwen3.5 (`variant`, of QWEN3_VL_VARIANTS) saved in float32 with the tokenizer and
    preprocessor config; returns the transformers model."""
    import torch
    import transformers

    config_class, model_class, text, vision = QWEN3_VL_VARIANTS[variant]
    partial = {"partial_rotary_factor": 0.25} if variant.startswith("qwen3_5") else {}
    text = dict(text, rope_parameters={"rope_type": "default", "mrope_section": [3, 3, 2], "mrope_interleaved": True,
                                       "rope_theta": 10000.0, **partial})
    config = getattr(transformers, config_class)(
        text_config=text, vision_config=vision, image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, tie_word_embeddings=False)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):  # decays from e^-0.4 to e^-2.7 per token: the state matters, and fades
                param.uniform_(-1.0, 1.0)
            elif not name.endswith(("norm.weight", "norm1.weight", "norm2.weight")):
                param.normal_(0, std)
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    save_vision_tokenizer(path)
    (path / "preprocessor_config.json").write_text(json.dumps(QWEN3_PREPROCESSOR))
    return model


# Gemma 4's processor with 4-pixel patches pooled 2 x 2: pictures up to 70 soft tokens (HF's smallest budget).
GEMMA4_PREPROCESSOR = {"image_processor_type": "Gemma4ImageProcessor", "patch_size": 4, "max_soft_tokens": 70,
                       "pooling_kernel_size": 2, "resample": 3, "do_normalize": False}
GEMMA4_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=12, patch_size=4, pooling_kernel_size=2,
                     position_embedding_size=160)  # a 70-token picture's longest side: 140 patches
GEMMA4_TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, global_head_dim=32, sliding_window=8, max_position_embeddings=2048,
                   final_logit_softcapping=30.0, hidden_size_per_layer_input=0)
_S, _F = "sliding_attention", "full_attention"
GEMMA4_VL_VARIANTS = {  # windows of 8: far shorter than an image
    "plain": dict(GEMMA4_TEXT, num_hidden_layers=3, layer_types=[_S, _S, _F]),  # causal over images
    # E2B/E4B's per-layer inputs and KV-shared layers, and images attending both ways in the sliding layers; a
    # global layer before a sliding one that computes its K/V, so the global layers' mask shows in the logits
    "rich": dict(GEMMA4_TEXT, num_hidden_layers=5, layer_types=[_S, _F, _S, _S, _F], num_kv_shared_layers=2,
                 hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, use_bidirectional_attention="vision"),
}


def gemma4_vl_checkpoint(path: Path, variant: str = "plain", seed: int = 0, std: float = 0.2):
    """A random Gemma 4 (`variant`, of GEMMA4_VL_VARIANTS) with its vision encoder and no audio tower, saved in
    float32 with the tokenizer and preprocessor config; returns the transformers model."""
    import torch
    import transformers

    config = transformers.Gemma4Config(
        text_config=GEMMA4_VL_VARIANTS[variant], vision_config=GEMMA4_VISION, audio_config=None,
        image_token_id=GEMMA4_IMAGE, boi_token_id=GEMMA4_BOI, eoi_token_id=GEMMA4_EOI)
    for part in (config, config.text_config, config.vision_config):
        part._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, std)
            if name.endswith("norm.weight"):  # Gemma 4's norms scale by w: drawn about 1 (q and k: 0.5, so
                param.add_(0.5 if name.endswith(("q_norm.weight", "k_norm.weight")) else 1.0)  # scale-1
                # attention over prompts of 150 tokens does not amplify float32's rounding past 1e-4)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.5, 1.5)
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    save_vision_tokenizer(path, GEMMA4_IMAGE_MARKUP)
    (path / "preprocessor_config.json").write_text(json.dumps(GEMMA4_PREPROCESSOR))
    return model


def drawn_image(width: int, height: int, seed: int = 0, text: str = "tinymlx") -> Image.Image:
    """A gradient with noise, a shape and some text: every patch differs."""
    rng = np.random.default_rng(seed)
    x, y = np.meshgrid(np.linspace(0, 1, width), np.linspace(0, 1, height))
    pixels = np.stack([x, y, (x + y) / 2], axis=-1) * 200 + rng.uniform(0, 55, (height, width, 3))
    image = Image.fromarray(pixels.astype(np.uint8))
    draw = ImageDraw.Draw(image)
    draw.ellipse((width // 4, height // 4, width // 2, height // 2), fill=(20, 160, 90))
    draw.text((2, 2), text, fill=(255, 255, 255))
    return image


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


# -- driving an engine with image requests ------------------------------------------------------------
def qwen_prompt(num_images: int, text: str = "what is this?") -> list[int]:
    """<user>, then each image between its vision tokens, then the question, as token ids."""
    ids = list(b"<user>")
    for _ in range(num_images):
        ids += [VISION_START, IMAGE_PAD, VISION_END] + list(b" and ")
    return ids + list(text.encode()) + list(b"\n<assistant>")


def image_messages(*images, text: str = "what is this?", before: str = "") -> list[dict]:
    """One user turn: optional text, the images (any form the engine takes), then the question."""
    parts = [{"type": "text", "text": before}] if before else []
    parts += [*({"type": "image", "image": image} for image in images), {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def load_engine(path: Path, **config):
    """The checkpoint in `path` behind an engine (block size 8 unless `config` says otherwise)."""
    from tinymlx.core.config import EngineConfig
    from tinymlx.engine.engine import Engine
    from tinymlx.text.tokenizer import Tokenizer

    return Engine.load(path, Tokenizer.from_dir(path), EngineConfig(**{"block_size": 8, **config}))


def run_requests(engine, requests: dict[str, list[dict]], params) -> dict[str, list[int]]:
    """Each request's output tokens, run to the end; the engine's invariants hold after every step, and no
    block is held at the end."""
    for request_id, messages in requests.items():
        engine.add_request(messages, params, request_id=request_id)
    done = {}
    while engine.has_unfinished_requests:
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.token_ids
        engine.check()
    assert engine.kv_coordinator.num_used_pages == 0
    return done
