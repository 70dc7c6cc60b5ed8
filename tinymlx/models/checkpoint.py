"""Reading a Hugging Face-format directory: its config.json and every *.safetensors tensor by name.

It lives with the models (which build themselves from these) so that the loader, which converts
GGUF files using the families' declarations, depends on models and never the other way round.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from tinymlx.core.errors import ModelLoadError


def load_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLoadError(f"{path} not found: not a Hugging Face model directory") from None
    except ValueError as error:
        raise ModelLoadError(f"{path} is not valid JSON: {error}") from None


def load_weights(model_dir: Path) -> dict[str, mx.array]:
    """Every tensor of every *.safetensors file, by Hugging Face name; MLX-quantized ones as stored."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights")
    weights: dict[str, mx.array] = {}
    for file in files:
        try:
            weights.update(mx.load(str(file)))
        except (RuntimeError, ValueError) as error:
            raise ModelLoadError(f"{file} is not a readable safetensors file: {error}") from None
    return weights


# Where a vision-language checkpoint keeps its text model (transformers 4.x and 5.x), and the names it has as a text model.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                  ("language_model.lm_head.", "lm_head."))


def text_model_weights(weights: dict[str, mx.array], not_text: tuple[str, ...]) -> dict[str, mx.array]:
    """A vision-language checkpoint's text model, named as a text-only checkpoint names it; tensors under
    `not_text` are dropped (mx.load is lazy: a dropped tensor is never read)."""
    renamed = {}
    for name, value in weights.items():
        if name.startswith(not_text):
            continue
        for prefix, replacement in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = replacement + name[len(prefix):]
                break
        renamed[name] = value
    return renamed
