"""Model files in, a Hugging Face-format directory out: offline packages, GGUF conversion, HF dirs."""

from tinymlx.core.errors import ModelLoadError
from tinymlx.loader.gguf import convert_gguf
from tinymlx.loader.hf import load_config, load_weights, resolve_model_dir
from tinymlx.loader.offline import DEFAULT_MODEL, OFFLINE_MODELS, OfflineModel, cache_dir, fetch_model

__all__ = [
    "DEFAULT_MODEL",
    "OFFLINE_MODELS",
    "ModelLoadError",
    "OfflineModel",
    "cache_dir",
    "convert_gguf",
    "fetch_model",
    "load_config",
    "load_weights",
    "resolve_model_dir",
]
