"""model_type -> family: the one place that names every family's module."""

from __future__ import annotations

from dataclasses import dataclass

from tinymlx.core.errors import ModelLoadError
from tinymlx.models import (
    gemma3,
    gemma4,
    gemma4_vl,
    gpt_oss,
    qwen2,
    qwen2_5_vl,
    qwen3,
    qwen3_5,
    qwen3_5_vl,
    qwen3_moe,
    qwen3_next,
    qwen3_vl,
)
from tinymlx.models.base import BaseModelArgs, CausalLM
from tinymlx.models.gguf_arch import GGUFArch


@dataclass(frozen=True)
class Family:
    args: type[BaseModelArgs]  # with from_config(config.json as a dict)
    model: type[CausalLM]


FAMILIES = {
    "qwen2": Family(qwen2.ModelArgs, qwen2.Model),
    "llama": Family(qwen2.ModelArgs, qwen2.Model),
    "qwen3": Family(qwen3.ModelArgs, qwen3.Model),
    "qwen3_moe": Family(qwen3_moe.ModelArgs, qwen3_moe.Model),
    "gemma3_text": Family(gemma3.ModelArgs, gemma3.Model),
    "gemma3": Family(gemma3.ModelArgs, gemma3.VisionModel),  # with its vision tower
    "qwen3_5_text": Family(qwen3_5.ModelArgs, qwen3_5.Model),
    "qwen3_5": Family(qwen3_5_vl.ModelArgs, qwen3_5_vl.Model),  # with its vision tower
    "qwen3_5_moe_text": Family(qwen3_5.ModelArgs, qwen3_5.Model),
    "qwen3_5_moe": Family(qwen3_5_vl.ModelArgs, qwen3_5_vl.Model),
    "qwen2_5_vl": Family(qwen2_5_vl.ModelArgs, qwen2_5_vl.Model),  # with its vision tower
    "qwen3_vl": Family(qwen3_vl.ModelArgs, qwen3_vl.Model),  # with its vision tower (DeepStack)
    "qwen3_vl_moe": Family(qwen3_vl.ModelArgs, qwen3_vl.Model),
    "qwen3_next": Family(qwen3_next.ModelArgs, qwen3_next.Model),
    "gpt_oss": Family(gpt_oss.ModelArgs, gpt_oss.Model),
    "gemma4_text": Family(gemma4.ModelArgs, gemma4.Model),
    "gemma4": Family(gemma4_vl.ModelArgs, gemma4_vl.Model),  # with its vision encoder (audio tower dropped)
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
# general.architecture -> how to convert it; each family declares the GGUF architectures it reads.
GGUF_ARCHITECTURES = {arch.name: arch for module in (qwen2, qwen3, qwen3_moe, gemma3, gpt_oss, gemma4)
                      for arch in module.GGUF_ARCHS}


# Vision-language model types whose checkpoints also come without a tower (mlx-lm's text conversions keep
# the model_type): with no vision_config they are their text model, whole (nothing is left unloaded).
TEXT_MODEL_OF = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def model_type_of(config: dict) -> str | None:
    """The model type a config.json is built as: its own, or its text model's where it names no tower."""
    model_type = config.get("model_type")
    if model_type in TEXT_MODEL_OF and "vision_config" not in config:
        return TEXT_MODEL_OF[model_type]
    return model_type


def family_for(model_type: str | None, where: str = "") -> Family:
    if model_type not in FAMILIES:
        raise ModelLoadError(f"{where}model_type {model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    return FAMILIES[model_type]


def gguf_arch_for(name: str | None, where: str = "") -> GGUFArch:
    if name not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{where}GGUF architecture {name!r} is not supported "
                             f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    return GGUF_ARCHITECTURES[name]
