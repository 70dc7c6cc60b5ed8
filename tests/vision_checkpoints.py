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
VOCAB = 300
# Qwen2-VL's template's way with content parts, on the byte tokenizer's plain turns.
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}"
            "{% for p in m.content %}{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
            "{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}<assistant>")
QWEN_PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": 14, "merge_size": 2,
                     "temporal_patch_size": 2, "min_pixels": 3136, "max_pixels": 28 * 28 * 40,
                     "image_mean": [0.48145466, 0.4578275, 0.40821073],
                     "image_std": [0.26862954, 0.26130258, 0.27577711]}


def save_vision_tokenizer(path: Path) -> None:
    tokenizer = byte_tokenizer_backend()
    tokenizer.add_special_tokens(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "chat_template": TEMPLATE}))


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
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
                param.normal_(0, std)
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    save_vision_tokenizer(path)
    (path / "preprocessor_config.json").write_text(json.dumps(QWEN_PREPROCESSOR))
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
